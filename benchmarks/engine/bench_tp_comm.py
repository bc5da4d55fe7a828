#!/usr/bin/env python3
"""Tensor parallel on the CPU (issue 39, item 1): the communication TP = 2 adds, per layer per step.

A Llama of --hidden wide (heads of 64, half as many kv heads, MLP 3x, the demo tokenizer's vocabulary), random weights,
float32, served by the engine at --tensor-parallel-size 2 (gloo, one thread per rank) for a batch of
--batch prompts of --prompt tokens with two adapters (ranks 8 and 16) and base rows; the prefill step(s)
and the decode steps are metered apart on rank 0 (server.engine.parallel.collectives): bytes and seconds
of the row-parallel all_reduces (2 per layer per step: o and down; the LoRA deltas ride them) and of the
lm_head's logits all_gather (1 per step); with --fully-sharded-loras, also the shrink outputs' all_gathers
(qkv, gate_up) and all_reduces (o, down) per layer. Tokens/s beside TP = 1 at one and two threads, for scale: on a
2-core machine shared by others, TP = 2 buys memory (each rank holds half the projections), not speed.

    .venv/bin/python -m benchmarks.engine.bench_tp_comm --json docs/benchmarks/tp-comm-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

from benchmarks.profile.cpu_model import cpu_model
from server.demo import make_adapter, make_base_model
from server.engine import LLM, SamplingParams
from server.engine.config import ModelConfig



def build(root: Path, hidden: int, layers: int) -> tuple[Path, dict[str, Path]]:
    model = make_base_model(root / "base", "llama", hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                            num_kv_heads=hidden // 128, intermediate_size=3 * hidden)
    return model, {"r8": make_adapter(model, root / "r8", r=8, lora_alpha=16, seed=1),
                   "r16": make_adapter(model, root / "r16", r=16, lora_alpha=16, seed=2)}


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def comm_row(comm, layers: int, seconds: float, steps: int) -> dict:
    """Per layer per step: the all_reduces; per step: the all_gathers (the logits', plus the shrinks' when
    fully sharded)."""
    return {"steps": steps, "seconds": seconds,
            "all_reduce_bytes_per_layer_step": comm.bytes["all_reduce"] / (steps * layers),
            "all_reduce_ms_per_layer_step": 1e3 * comm.seconds["all_reduce"] / (steps * layers),
            "all_gather_bytes_per_step": comm.bytes["all_gather"] / steps,
            "all_gather_ms_per_step": 1e3 * comm.seconds["all_gather"] / steps}


def serve_batch(llm: LLM, prompts, names, tokens: int, tag: str) -> tuple[float, float, dict | None, int]:
    """Every request added, then one step (the prefill: the batch fits one step's tokens), then the decode
    steps until done: (prefill seconds, decode seconds, the prefill's communication, decode steps)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens + 1)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"{tag}-{i}", prompt, params, llm._versions.get(name) if name else None)
    start = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - start
    comm = getattr(engine.runner, "comm", None)
    snapshot = None
    if comm is not None:
        snapshot = comm_row(comm, llm.engine.model_config.num_layers, prefill, 1)
        comm.reset()
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return prefill, time.perf_counter() - start, snapshot, steps


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model, adapters = build(Path(tmp), args.hidden, args.layers)
        names = [None, "r8", "r16", "r8"] * (args.batch // 4)
        vocab = ModelConfig.from_dir(model).vocab_size
        prompts = prompts_of(len(names), args.prompt, vocab, seed=0)
        kw = dict(device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=64 * args.batch,
                  max_model_len=args.prompt + args.tokens + 16, enable_prefix_caching=False)
        result = {}
        arms = (("tp2", 2, 1, False), ("tp2_fully_sharded", 2, 1, True), ("tp1_1thread", 1, 1, False),
                ("tp1_2threads", 1, 2, False))
        for label, tp, threads, fully in arms:
            llm = LLM(model, tensor_parallel_size=tp, cpu_threads=threads, fully_sharded_loras=fully, **kw)
            for name, path in adapters.items():
                llm.add_adapter(name, path)
            serve_batch(llm, prompts[:2], names[:2], 2, "warm")
            comm = getattr(llm.engine.runner, "comm", None)
            if comm is not None:
                comm.reset()
            prefill_s, decode_s, prefill_comm, decode_steps = serve_batch(llm, prompts, names, args.tokens, label)
            row = {"prefill_s": prefill_s, "decode_tok_s": len(prompts) * args.tokens / decode_s}
            if comm is not None:
                row["prefill"] = prefill_comm
                row["decode"] = comm_row(comm, args.layers, decode_s, decode_steps)
            llm.engine.shutdown()
            result[label] = row
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="a multiple of 4 (base, r8, r16, r8)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    load_start = os.getloadavg()
    result = run(args)
    out = {"cpu": cpu_model(), "machine": platform.machine(), "nproc": os.cpu_count(),
           "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "args": vars(args), "results": result}
    print(f"{'arm':18} {'prefill s':>9} {'decode tok/s':>12}   per layer per step (all_reduce) | per step (gather)")
    for label, row in result.items():
        line = f"{label:18} {row['prefill_s']:9.3f} {row['decode_tok_s']:12.1f}"
        for ph in ("prefill", "decode"):
            if ph in row:
                r = row[ph]
                line += (f"   {ph}: {r['all_reduce_bytes_per_layer_step'] / 1024:.1f} KiB "
                         f"{r['all_reduce_ms_per_layer_step']:.3f} ms | {r['all_gather_bytes_per_step'] / 1024:.1f} KiB "
                         f"{r['all_gather_ms_per_step']:.3f} ms")
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
