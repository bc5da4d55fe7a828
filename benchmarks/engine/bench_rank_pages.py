#!/usr/bin/env python3
"""Adapter memory paged by rank (--lora-page-rows) against today's max-rank slots (issue 38, item 1).

1. Residency: adapters resident per GiB of adapter memory. Both layouts get `--slots` slots' worth of
   memory at --max-lora-rank 128; adapters (every projection targeted) are loaded into a real
   server.engine.lora.slots.LoraSlots, ranks taken in turn from {8, 16, 64, 128} (equal counts) or one
   rank, until the next no longer fits. The count depends on the layout alone (pages per rank, entries),
   so the slots are built on a one-layer smol135 shape and the bytes reported for Llama-3-8B's 32 layers
   in bf16 (allocated on `meta`: every A, B, scaling and DoRA-scale buffer, plus the rank and page tables).
   Today's slots hold `--slots` adapters whatever their rank.
2. Decode tokens/s with every adapter resident, paged (pages of --page-rows rows) against slots, at
   equal rank (all adapters --decode-rank), in paired rounds whose order alternates; the ratio is the
   median of the per-round ratios. smol135 shape (random weights), float32, on the CPU.

Targets: mixed ranks >= 4x today's adapters per GiB, a single rank no fewer than today; decode >= 0.97x.
The machine is shared (eight sessions on 2 cores): the load average at start and end is in the JSON.

    .venv/bin/python -m benchmarks.engine.bench_rank_pages --json docs/benchmarks/rank-pages-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path
from types import MappingProxyType

import torch

from adapters.format import LoraAdapter, LoraWeights
from adapters.packed import pack_adapter
from benchmarks.aot.aot_shapes import MODELS
from benchmarks.engine.bench_int8 import decode_tok_s
from benchmarks.model_shape import MODEL_SHAPES, build_model_shape
from benchmarks.profile.cpu_model import cpu_model
from server.demo import make_adapter
from server.engine import LLM
from server.engine.config import ModelConfig
from server.engine.kv_cache import allocate_lora_slots
from server.engine.lora.paging import LoraPaging
from server.engine.lora.slots import PROJECTION_SLICES, LoraSlots

MAX_RANK = 128
MIXED = (8, 16, 64, 128)


def model_config(cfg: dict, layers: int) -> ModelConfig:
    return ModelConfig.from_dict({**cfg, "num_hidden_layers": layers})


def layout_bytes(mcfg: ModelConfig, paging: LoraPaging, dtype: torch.dtype) -> int:
    """Every adapter-memory buffer of the layout (on meta), plus the per-entry rank and page tables."""
    total = 0
    for layer in allocate_lora_slots(mcfg, paging.entries, MAX_RANK, dtype, "meta", paging):
        for g in layer.values():
            total += sum(t.numel() * t.element_size() for t in (g.a, *g.b, g.scaling, g.dora_scale))
    return total + paging.entries * 4 * (1 + (paging.pages_per_entry if paging.paged else 0))


def synthetic(mcfg: ModelConfig, rank: int, seed: int):
    """A packed adapter of `rank` on every projection of layer 0."""
    g = torch.Generator().manual_seed(seed)
    widths = {"q_proj": (mcfg.hidden_size, mcfg.q_size), "k_proj": (mcfg.hidden_size, mcfg.kv_size),
              "v_proj": (mcfg.hidden_size, mcfg.kv_size), "o_proj": (mcfg.q_size, mcfg.hidden_size),
              "gate_proj": (mcfg.hidden_size, mcfg.intermediate_size),
              "up_proj": (mcfg.hidden_size, mcfg.intermediate_size),
              "down_proj": (mcfg.intermediate_size, mcfg.hidden_size)}
    weights = {(0, p): LoraWeights(torch.randn(rank, n_in, generator=g), torch.randn(n_out, rank, generator=g), 1.0)
               for p, (n_in, n_out) in widths.items() if p in PROJECTION_SLICES}
    return pack_adapter(LoraAdapter(rank, tuple(sorted(widths)), False, MappingProxyType(weights), 0, {}),
                        torch.float32, pin=False)


def resident(paging: LoraPaging, ranks: tuple[int, ...]) -> int:
    """How many adapters, ranks in turn, a real LoraSlots of this layout holds (one smol135 layer)."""
    mcfg = model_config(MODEL_SHAPES["smol135"], 1)
    layers = allocate_lora_slots(mcfg, paging.entries, MAX_RANK, torch.float32, "cpu", paging)
    slots = LoraSlots(layers, paging.entries, paging=paging)
    adapters = {r: synthetic(mcfg, r, r) for r in set(ranks)}
    n = 0
    while slots.can_acquire(f"a{n}", adapters[ranks[n % len(ranks)]]) and n < 100_000:
        version = f"a{n}"
        slots.acquire(version, adapters[ranks[n % len(ranks)]])  # held: nothing may be evicted
        n += 1
    assert slots.evictions == 0
    return n


def residency(num_slots: int, page_rows: int) -> list[dict]:
    mcfg = model_config(MODELS["llama3-8b"], 32)
    today = LoraPaging.of(num_slots, MAX_RANK, None)
    paged = LoraPaging.of(num_slots, MAX_RANK, page_rows)
    gib = {name: layout_bytes(mcfg, p, torch.bfloat16) / 2**30 for name, p in (("slots", today), ("paged", paged))}
    rows = []
    for label, ranks in [("mixed 8/16/64/128", MIXED)] + [(f"rank {r}", (r,)) for r in MIXED]:
        n_today, n_paged = resident(today, ranks), resident(paged, ranks)
        per_today, per_paged = n_today / gib["slots"], n_paged / gib["paged"]
        rows.append({"ranks": label, "slots_resident": n_today, "paged_resident": n_paged,
                     "slots_gib": round(gib["slots"], 3), "paged_gib": round(gib["paged"], 3),
                     "slots_per_gib": round(per_today, 3), "paged_per_gib": round(per_paged, 3),
                     "ratio": round(per_paged / per_today, 3)})
    return rows


def decode(args, model_dir: Path, adapter_dirs: list[Path]) -> dict:
    common = dict(device="cpu", dtype="float32", max_loras=len(adapter_dirs), max_lora_rank=args.decode_max_rank,
                  kv_cache_blocks=64 * args.seqs // 16 + 16, max_model_len=256, cpu_threads=1)
    engines = {"slots": LLM(str(model_dir), **common),
               "paged": LLM(str(model_dir), lora_page_rows=args.page_rows, **common)}
    names = [f"a{i}" for i in range(len(adapter_dirs))]
    for llm in engines.values():
        for name, d in zip(names, adapter_dirs):
            llm.add_adapter(name, d)
        decode_tok_s(llm, names, args.seqs, 2, seed=0, tag="warm")  # every adapter resident from here on
    rounds = []
    for r in range(args.rounds):
        order = ("slots", "paged") if r % 2 == 0 else ("paged", "slots")
        tok_s = {k: decode_tok_s(engines[k], names, args.seqs, args.steps, seed=r, tag=f"r{r}{k}") for k in order}
        rounds.append({k: {"wall": round(v[0], 2), "cpu": round(v[1], 2)} for k, v in tok_s.items()})
        print(f"round {r}: slots {tok_s['slots'][0]:.1f} tok/s, paged {tok_s['paged'][0]:.1f} tok/s "
              f"({tok_s['paged'][0] / tok_s['slots'][0]:.3f}x wall, "
              f"{tok_s['paged'][1] / tok_s['slots'][1]:.3f}x cpu)")
    for llm in engines.values():
        assert llm.engine.lora_slots.evictions == 0, "every adapter stays resident"
    ratio = {m: statistics.median(x["paged"][m] / x["slots"][m] for x in rounds) for m in ("wall", "cpu")}
    return {"rank": args.decode_rank, "max_lora_rank": args.decode_max_rank, "page_rows": args.page_rows,
            "adapters": len(adapter_dirs), "seqs": args.seqs, "steps": args.steps, "rounds": rounds,
            "median_ratio_wall": round(ratio["wall"], 4), "median_ratio_cpu": round(ratio["cpu"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=16, help="slots' worth of adapter memory (default 16)")
    ap.add_argument("--page-rows", type=int, default=8, help="rank rows per page (default 8)")
    ap.add_argument("--decode-rank", type=int, default=16, help="every decode adapter's rank (default 16)")
    ap.add_argument("--decode-max-rank", type=int, default=16, help="--max-lora-rank of the decode engines")
    ap.add_argument("--adapters", type=int, default=8, help="adapters in the decode batch (default 8)")
    ap.add_argument("--seqs", type=int, default=16, help="decoding sequences (default 16)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round and engine (default 16)")
    ap.add_argument("--rounds", type=int, default=8, help="paired rounds (default 8)")
    ap.add_argument("--layers", type=int, default=4, help="smol135 layers of the decode model (default 4)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    load_at_start = os.getloadavg()
    table = residency(args.slots, args.page_rows)
    print(f"adapters resident per GiB (Llama-3-8B bf16, {args.slots} slots' worth at max rank {MAX_RANK}, "
          f"pages of {args.page_rows} rows)")
    print(f"{'ranks':<20}{'slots':>8}{'paged':>8}{'slots/GiB':>12}{'paged/GiB':>12}{'ratio':>8}")
    for row in table:
        print(f"{row['ranks']:<20}{row['slots_resident']:>8}{row['paged_resident']:>8}"
              f"{row['slots_per_gib']:>12.2f}{row['paged_per_gib']:>12.2f}{row['ratio']:>8.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_shape("smol135", Path(tmp) / "model", num_layers=args.layers)
        dirs = [make_adapter(model_dir, Path(tmp) / f"a{i}", r=args.decode_rank, seed=i + 1)
                for i in range(args.adapters)]
        decoded = decode(args, model_dir, dirs)
    print(f"decode, all {args.adapters} adapters resident at rank {args.decode_rank}: paged / slots = "
          f"{decoded['median_ratio_wall']:.3f}x wall, {decoded['median_ratio_cpu']:.3f}x cpu (median of "
          f"{args.rounds} paired rounds)")
    report = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average_start": load_at_start,
                    "load_average_end": os.getloadavg(),
                    "shared": "yes: eight sessions share these 2 cores; wall ratios are noisy, cpu-time ratios less"},
        "residency": {"model": "llama3-8b bf16 (bytes); counts from a real LoraSlots", "max_lora_rank": MAX_RANK,
                      "slots": args.slots, "page_rows": args.page_rows, "rows": table},
        "decode": decoded,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
