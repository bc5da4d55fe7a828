#!/usr/bin/env python3
"""Where a CPU engine step's time goes: a decode step and a prefill step, by phase, part and op.

Builds the `--model-shape` model (random weights, no hub) and rank-8 adapters on all seven
projections, fills the engine with `--decode-seqs` sequences decoding at `--context` tokens over
`--adapters` adapters, and profiles `--steps` decode steps with torch.profiler; then profiles the
steps that prefill `--prefill-seqs` prompts of `--prefill-len` tokens. Three views per step kind:

- phase: the engine step's own parts (schedule, prepare, forward, sample, postprocess), wall time;
- part: the forward's kernels (LoRA, both sides fused; KV write; attention; each a record_function
  around the engine's KernelOps entry), the base projections (KernelOps.linear into the workspace),
  the lm_head (KernelOps.linear on the vocabulary) and the rest (norms, rope, activations, copies);
- op: torch.profiler's self CPU time per aten op, top `--top`.

Prints the tables and writes JSON. Absolute times are this machine's; shares are what to attack.

    .venv/bin/python -m benchmarks.profile.profile_step --adapters 8 --cpu-threads 1 --json bench-out/profile.json
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.model_shape import MODEL_SHAPES, build_model_shape
from benchmarks.profile.step_phases import PHASES, timed_phases
from server.bench.synth_adapters import ensure_adapters
from server.engine import LLM, SamplingParams

KERNEL_PARTS = ("lora", "write_kv", "paged_attention")
PARTS = (*KERNEL_PARTS, "base linear", "lm_head")


def _labelled(name: str, fn):
    def run(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return run


def _labelled_linear(linear):
    """The layers' projections write into the workspace (out=); the lm_head's logits are a new tensor."""
    def run(*args, out=None, **kwargs):
        with record_function("lm_head" if out is None else "base linear"):
            return linear(*args, out=out, **kwargs)
    return run


def _label_kernels(llm: LLM) -> None:
    """Each kernel entry runs inside a record_function of its name (on this engine instance only)."""
    ops = llm.engine.runner.ops
    labelled = {n: _labelled(n, getattr(ops, n)) for n in KERNEL_PARTS if n != "lora"}
    labelled["lora"] = copy.copy(ops.lora)  # the strategy object, its apply labelled
    labelled["lora"].apply = _labelled("lora", ops.lora.apply)
    llm.engine.runner.ops = dataclasses.replace(ops, linear=_labelled_linear(ops.linear),
                                                int8_linear=_labelled_linear(ops.int8_linear), **labelled)


def _parts(prof, steps: int) -> dict[str, float]:
    """ms per step of each part of the forward, from the profiler's events."""
    ms = {n: 0.0 for n in PARTS}
    for e in prof.key_averages():
        if e.key in PARTS:
            ms[e.key] += e.cpu_time_total / 1000
    return {k: v / steps for k, v in ms.items()}


def _ops(prof, steps: int, top: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1000 / steps, "calls": e.count // steps}
            for e in rows[:top] if e.key not in PARTS]


def _profile_steps(llm: LLM, timers: dict, steps: int, top: int) -> dict:
    engine = llm.engine
    for t in timers.values():
        t.total = 0.0
    walls = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
    phases = {k: 1000 * timers[k].total / steps for k in PHASES}
    parts = _parts(prof, steps)
    parts["rest of forward"] = max(0.0, phases["forward"] - sum(parts.values()))
    return {"steps": steps, "step_ms_median": 1000 * statistics.median(walls), "phase_ms": phases,
            "part_ms": parts, "top_ops": _ops(prof, steps, top)}


def _add(llm: LLM, names: list[str], n: int, prompt_len: int, max_tokens: int, rng: random.Random, tag: str):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        name = names[i % len(names)] if names else None
        prompt = [rng.randrange(3, 500) for _ in range(prompt_len)]
        llm.engine.add_request(f"{tag}{i}", prompt, params, llm._versions[name] if name else None, f"t{i % 4}")


def run(args) -> dict:
    dtype = getattr(torch, args.dtype)
    model_dir = build_model_shape(args.model_shape, Path(args.work_dir) / f"{args.model_shape}-{args.dtype}",
                                  num_layers=args.layers, dtype=dtype)
    adapters = ensure_adapters(model_dir, Path(args.work_dir) / "adapters", list(range(args.adapters)), r=8,
                               dtype=dtype)
    kv_blocks = 4 * (args.decode_seqs + args.prefill_seqs) * (-(-(args.context + args.prefill_len + 64) // 16))
    llm = LLM(model_dir, device="cpu", dtype=args.dtype, cpu_threads=args.cpu_threads, max_loras=max(1, args.adapters),
              max_lora_rank=8, max_num_seqs=max(args.decode_seqs, args.prefill_seqs), kv_cache_blocks=kv_blocks,
              enable_prefix_caching=False, quantization=args.quantization)
    names = [f"a{i}" for i in adapters]
    for i, path in adapters.items():
        llm.add_adapter(f"a{i}", path)
    rng = random.Random(args.seed)
    engine = llm.engine
    # Warm: every adapter resident and every code path run once before anything is timed.
    _add(llm, names, max(1, len(names)), 16, 2, rng, "warm")
    while engine.has_unfinished_requests():
        engine.step()
    _label_kernels(llm)
    with timed_phases(engine) as timers:
        _add(llm, names, args.decode_seqs, args.context, args.steps + 64, rng, "d")
        while any(s.num_pending_tokens > 1 for s in engine.scheduler.running) or engine.stats().scheduler.waiting:
            engine.step()  # until every sequence decodes
        engine.step()
        decode = _profile_steps(llm, timers, args.steps, args.top)
        for rid in list(engine.seqs):
            engine.abort_request(rid)
        engine.step()

        _add(llm, names, args.prefill_seqs, args.prefill_len, 1, rng, "p")
        prefill = _profile_steps(llm, timers, 1, args.top)
        while engine.has_unfinished_requests():
            engine.step()
    return {"model_shape": args.model_shape, "layers": args.layers, "dtype": args.dtype,
            "quantization": args.quantization, "int8_matmul": engine.kernels.int8_linear.__name__,
            "cpu_threads": torch.get_num_threads(), "adapters": args.adapters, "torch": torch.__version__,
            "decode": {"seqs": args.decode_seqs, "context": args.context, **decode},
            "prefill": {"seqs": args.prefill_seqs, "prompt_len": args.prefill_len, **prefill}}


def format_report(doc: dict) -> str:
    quantized = f" int8 ({doc['int8_matmul']})" if doc.get("quantization") else ""
    lines = [f"{doc['model_shape']} {doc['dtype']}{quantized}, {doc['cpu_threads']} thread(s), "
             f"{doc['adapters']} adapter(s), torch {doc['torch']}"]
    for kind in ("decode", "prefill"):
        r = doc[kind]
        what = (f"{r['seqs']} seqs at context {r['context']}" if kind == "decode"
                else f"{r['seqs']} prompts x {r['prompt_len']} tokens")
        total = sum(r["phase_ms"].values())
        lines += ["", f"## {kind} step ({what}): median {r['step_ms_median']:.1f} ms", "",
                  "| phase | ms | share |", "|---|---|---|"]
        lines += [f"| {k} | {v:.2f} | {100 * v / total:.1f}% |" for k, v in r["phase_ms"].items()]
        fwd = r["phase_ms"]["forward"] or 1.0
        lines += ["", "| forward part | ms | share of forward |", "|---|---|---|"]
        lines += [f"| {k} | {v:.2f} | {100 * v / fwd:.1f}% |" for k, v in r["part_ms"].items()]
        lines += ["", "| op (self time) | ms | calls |", "|---|---|---|"]
        lines += [f"| {o['op']} | {o['self_ms']:.2f} | {o['calls']} |" for o in r["top_ops"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-shape", default="smol135", choices=sorted(MODEL_SHAPES))
    p.add_argument("--layers", type=int, default=None, help="fewer layers of the same widths")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--cpu-threads", default="auto")
    p.add_argument("--quantization", default=None, choices=("int8",),
                   help="the decoder projections' weights (default: float, the --dtype)")
    p.add_argument("--adapters", type=int, default=8, help="adapters the sequences spread over (0: base)")
    p.add_argument("--decode-seqs", type=int, default=32)
    p.add_argument("--context", type=int, default=96)
    p.add_argument("--prefill-seqs", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="bench-out/work")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    doc = run(args)
    print(format_report(doc))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
