#!/usr/bin/env python3
"""DoRA against plain LoRA of the same rank, side by side in one run: load time and decode throughput.

1. Load time, Redis -> device slot, as the engine pages an adapter in: read the version's files from a
   real redis-server (adapters.registry), parse and validate them (adapters.format), pack them for the
   host tier (adapters.packed; on a CPU engine the host tier then gets a DoRA adapter's per-output
   scales m / ||W + s B A|| against the base weights, so "pack" includes them), copy them into a device
   slot (server.engine.lora.slots; "slot" is what a later page-in of the same adapter costs). A DoRA
   load is timed three ways: "dora_after_upload", the first load after the server accepted the
   version (its scales deleted, then computed and stored as the upload does before answering,
   server.engine.lora.dora_precompute, timed apart as "intake_precompute_ms": what DoRA adds to the
   upload's latency); "dora_reload", a later load (after a host eviction, on another replica, after a
   restart), which reads them from Redis too; "dora_first", a load that finds none in Redis and
   computes and stores them (the fallback: a version accepted while the precompute queue was full, or
   by a server with another base). Rounds alternate the kinds (the order flips each round); each load
   is timed with its stages and the slot is freed again after it. The base weights' identity that
   stored scales are keyed by is computed once per process, at engine start-up ("base_identity_ms").
2. Decode tokens/s of a batch whose sequences all use DoRA adapters against one whose sequences all use
   plain LoRA adapters (`--seqs` sequences over `--adapters` adapters each; both sets resident in
   slots of one engine), in paired rounds.

Targets (issue 28): DoRA load <= 2x the LoRA load (every load the server makes: after upload and
reloads; the "dora_first" fallback also computes the scales); DoRA decode >= 0.9x LoRA decode. Medians over
rounds. The smol135 shape (benchmarks.model_shape, random weights), float32, on the CPU.

    .venv/bin/python -m benchmarks.engine.bench_dora --json docs/benchmarks/dora-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import redis
import torch

from adapters.dora_scale_store import DoraScaleStore
from adapters.format import inspect_adapter_bytes, load_adapter_bytes
from adapters.registry import AdapterRegistry
from benchmarks.engine.bench_int8 import decode_tok_s
from benchmarks.model_shape import build_model_shape
from server.demo import make_adapter
from server.embedded_redis.server import EmbeddedRedis
from server.engine import LLM
from server.engine.lora.dora_precompute import DoraPrecompute

KINDS = ("lora", "dora")
# A DoRA load after its upload computed the scales, a reload reading them, a load computing them (the fallback)
LOADS = ("lora", "dora_after_upload", "dora_reload", "dora_first")
STAGES = ("fetch_ms", "parse_ms", "pack_ms", "slot_ms", "total_ms")


def timed_load(llm: LLM, registry: AdapterRegistry, version: str, max_rank: int) -> dict[str, float]:
    """One page-in of `version`, Redis -> device slot, by stage (ms); the slot is freed afterwards."""
    engine = llm.engine
    t0 = time.perf_counter()
    config_json, weights = registry.read_files(version)
    t1 = time.perf_counter()
    adapter = load_adapter_bytes(config_json, weights, engine.adapter_shape, max_rank)
    t2 = time.perf_counter()
    packed = engine.host.packed(adapter, version)  # a DoRA adapter's scales: read from Redis, else computed
    t3 = time.perf_counter()
    engine.lora_slots.acquire(version, packed)
    t4 = time.perf_counter()
    engine.lora_slots.release(version)
    engine.lora_slots.remove(version)
    ms = [1e3 * (b - a) for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t0, t4))]
    return dict(zip(STAGES, ms))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16, help="rank of both adapters (default 16)")
    ap.add_argument("--loads", type=int, default=5, help="timed loads per kind per round (default 5)")
    ap.add_argument("--seqs", type=int, default=8, help="decoding sequences per batch (default 8)")
    ap.add_argument("--adapters", type=int, default=8, help="adapters the sequences of a batch use (default 8)")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per kind per round (default 8)")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (default 5)")
    ap.add_argument("--model-dir", help="where the smol135-shaped model is built or reused (default: a temp dir)")
    ap.add_argument("--json", default="bench-out/dora-cpu.json", help="output (default bench-out/dora-cpu.json)")
    args = ap.parse_args()
    load_at_start = os.getloadavg()

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis.start(Path(tmp) / "redis") as redis_server:
        model_dir = build_model_shape("smol135", args.model_dir or Path(tmp) / "smol135")
        dirs = {kind: make_adapter(model_dir, Path(tmp) / kind, r=args.rank, lora_alpha=2 * args.rank, seed=5,
                                   use_dora=kind == "dora") for kind in KINDS}
        llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=2 * args.adapters + 1,
                  max_lora_rank=args.rank, kv_cache_blocks=64 * args.seqs // 16 + 16, max_model_len=256)
        client = redis.Redis.from_url(redis_server.url)
        registry = AdapterRegistry(client)
        # The offline LLM keeps no store; the server gives its engine one (server.api.state), and so the
        # intake's precompute, which computes the base identity as it starts (at engine start-up).
        cache = llm.engine.lora_slots.dora_cache
        cache.store = DoraScaleStore(client)
        precompute = DoraPrecompute(llm.engine.host, cache)
        identity_ms = cache.stats.base_identity_ms
        versions = {}
        for kind, d in dirs.items():
            config_json, weights = ((d / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors"))
            summary = inspect_adapter_bytes(config_json, weights, llm.engine.adapter_shape, args.rank)
            record = registry.put("bench", kind, summary.canonical_config_json, weights, summary=summary)
            versions[kind] = (record.version, summary.size_bytes)
        names = {kind: [f"{kind}{i}" for i in range(args.adapters)] for kind in KINDS}
        for kind in KINDS:
            for name in names[kind]:
                llm.add_adapter(name, dirs[kind])
            timed_load(llm, registry, versions[kind][0], args.rank)  # warm-up
            decode_tok_s(llm, names[kind], args.seqs, 2, seed=0, tag=f"warm-{kind}")

        intake_ms: list[float] = []

        def load(kind: str) -> dict[str, float]:
            version = versions["lora" if kind == "lora" else "dora"][0]
            if kind in ("dora_first", "dora_after_upload"):
                client.delete(f"lp:ad:dora:{version}")  # the registry's key for the version's scales
            if kind == "dora_after_upload":  # what the upload does before it answers (server.api.adapter_intake)
                adapter = load_adapter_bytes(*registry.read_files(version), llm.engine.adapter_shape, args.rank)
                t = time.perf_counter()
                assert precompute.submit(version, adapter).result() == "computed"
                intake_ms.append(1e3 * (time.perf_counter() - t))
            return timed_load(llm, registry, version, args.rank)

        loads: dict[str, list[dict[str, float]]] = {kind: [] for kind in LOADS}
        rounds = []
        for r in range(args.rounds):
            for kind in (LOADS if r % 2 == 0 else tuple(reversed(LOADS))):
                loads[kind] += [load(kind) for _ in range(args.loads)]
            order = KINDS if r % 2 == 0 else tuple(reversed(KINDS))
            row = {kind: decode_tok_s(llm, names[kind], args.seqs, args.steps, seed=r, tag=f"r{r}-{kind}")
                   for kind in order}
            row["ratio"] = row["dora"] / row["lora"]
            rounds.append(row)
            print(f"round {r}: decode lora {row['lora']:.2f} tok/s, dora {row['dora']:.2f} tok/s "
                  f"(x{row['ratio']:.3f}); load " + ", ".join(
                      f"{kind} {statistics.median(x['total_ms'] for x in loads[kind]):.1f} ms" for kind in LOADS),
                  flush=True)
        cache_stats = vars(cache.stats)
        precompute.shutdown()
        client.close()

    load_medians = {kind: {s: statistics.median(x[s] for x in loads[kind]) for s in STAGES} for kind in LOADS}
    lora_ms = load_medians["lora"]["total_ms"]
    summary = {
        "load_median_ms": load_medians,
        "load_ratio_dora_after_upload_over_lora": load_medians["dora_after_upload"]["total_ms"] / lora_ms,
        "load_ratio_dora_reload_over_lora": load_medians["dora_reload"]["total_ms"] / lora_ms,
        "load_ratio_dora_first_over_lora": load_medians["dora_first"]["total_ms"] / lora_ms,
        "base_identity_ms": identity_ms,
        "intake_precompute_median_ms": statistics.median(intake_ms),
        "dora_scale_cache": cache_stats,
        "decode_median_tok_s": {kind: statistics.median(r[kind] for r in rounds) for kind in KINDS},
        "decode_median_ratio_dora_over_lora": statistics.median(r["ratio"] for r in rounds),
        "adapter_size_bytes": {kind: versions[kind][1] for kind in KINDS},
    }
    print(f"\n{'load':>17} {'size MB':>8} " + " ".join(f"{s:>10}" for s in STAGES))
    for kind in LOADS:
        size = versions["lora" if kind == "lora" else "dora"][1]
        print(f"{kind:>17} {size / 1e6:>8.2f} " + " ".join(f"{load_medians[kind][s]:>10.1f}" for s in STAGES))
    print(f"decode tok/s: lora {summary['decode_median_tok_s']['lora']:.2f}, "
          f"dora {summary['decode_median_tok_s']['dora']:.2f}; base identity {identity_ms:.0f} ms at start-up; "
          f"the upload's precompute {summary['intake_precompute_median_ms']:.0f} ms")
    print(f"DoRA/LoRA: load after upload x{summary['load_ratio_dora_after_upload_over_lora']:.3f}, reload from Redis "
          f"x{summary['load_ratio_dora_reload_over_lora']:.3f} (target <= 2), load computing the scales "
          f"(fallback) x{summary['load_ratio_dora_first_over_lora']:.3f}, decode "
          f"x{summary['decode_median_ratio_dora_over_lora']:.3f} (target >= 0.9); medians of {args.rounds} rounds, "
          f"{args.rounds * args.loads} loads each")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": "smol135 shape (random weights)", "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "load_average_start": load_at_start,
        "load_average": os.getloadavg(),
        "rank": args.rank, "seqs": args.seqs, "adapters": args.adapters, "steps": args.steps, "loads": args.loads,
        "rounds": rounds, "loads_ms": loads, "intake_precompute_ms": intake_ms, **summary,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
