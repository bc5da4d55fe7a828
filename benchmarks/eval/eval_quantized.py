#!/usr/bin/env python3
"""The quality cost of a quantized base against the unquantized model, on the real-model evaluation's items.

    .venv/bin/python -m benchmarks.eval.eval_quantized --json docs/benchmarks/eval-quantized.json
    .venv/bin/python -m benchmarks.eval.eval_quantized --limit 32 --variants int8     # a quick slice

Loads the real default model (SmolLM2-135M-Instruct, converted once) with the demo adapters into the
offline engine (server.engine.LLM, in-process: no HTTP) twice, float32 and quantized, and for the base
and every adapter, greedy: teacher-forced top-1 agreement and mean KL(float || quantized) per token
over the float model's continuation, greedy reply agreement, and each adapter's effect rate on both
sides (benchmarks.eval.quant_eval). Checks issue 27's targets (top-1 >= 95%, mean KL <= 0.02 nats/token,
each effect rate within 3 points of float), prints a table per variant and writes JSON.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.eval.eval_real_model import add_eval_set_args, adapter_dirs, default_model_dir, spread
from server.bench.eval_items import load_items

# variant name -> the EngineConfig fields that make it (float32 activations throughout)
VARIANTS = {"int8": {"quantization": "int8"}, "int8-lm-head": {"quantization": "int8", "quantize_lm_head": True},
            "int4": {"quantization": "int4"}, "int4-g64": {"quantization": "int4", "int4_group_size": 64},
            "int4-g128": {"quantization": "int4", "int4_group_size": 128},
            "fp8-kv": {"kv_cache_dtype": "fp8_e4m3"},
            "fp8_e5m2-kv": {"kv_cache_dtype": "fp8_e5m2"}}


def engine(model_dir: Path, adapters: dict[str, Path], threads: int, **quant):
    from server.engine import LLM

    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=max(1, len(adapters)), max_lora_rank=8,
              enable_prefix_caching=False, cpu_threads=threads, **quant)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_set_args(p, "the conversion cache")
    p.add_argument("--max-tokens", type=int, default=24, help="greedy reply length cap (default 24, as the eval)")
    p.add_argument("--variants", default="int8,fp8-kv",
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default int8,fp8-kv)")
    p.add_argument("--chunk", type=int, default=16, help="items per engine call (default 16)")
    p.add_argument("--models", default=None,
                   help="comma-separated, of base and the adapters' names: compare only these (default: all; a "
                        "long run split over several calls, e.g. one adapter's effect items each)")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", type=Path, default=Path("bench-out/eval-quantized.json"),
                   help="where to write the JSON (default bench-out/eval-quantized.json)")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    from benchmarks.eval.quant_eval import compare, format_table, targets
    from server.bench.artifacts import write_json
    from server.bench.environment import machine_state

    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    items = load_items(args.items)
    items = spread(items, args.limit) if args.limit else items
    model_dir = args.model or default_model_dir(args.data_dir)
    adapters = adapter_dirs(args.adapters)
    models = [None, *adapters] if args.models is None else [None if m == "base" else m for m in args.models.split(",")]
    if any(m is not None and m not in adapters for m in models) or not models:
        p.error(f"--models: choose from base, {', '.join(sorted(adapters))}")
    doc = {"model": model_dir.name, "adapters": sorted(adapters), "models": [m or "base" for m in models],
           "items_file": str(args.items), "items": len(items), "max_tokens": args.max_tokens,
           "activations": "float32", "cpu_threads": args.cpu_threads, "greedy": True,
           "machine": machine_state(log), "load_avg_start": os.getloadavg(), "variants": {}}
    ref = engine(model_dir, adapters, args.cpu_threads)
    for variant in variants:
        started = time.monotonic()
        log(f"{variant}: {len(items)} items x {len(models)} models")
        quant = engine(model_dir, adapters, args.cpu_threads, **VARIANTS[variant])
        body = compare(ref, quant, items, models, max_tokens=args.max_tokens, chunk=args.chunk, log=log)
        del quant
        body["targets"] = targets(body)
        body["seconds"] = round(time.monotonic() - started, 1)
        body["engine_config"] = VARIANTS[variant]
        doc["variants"][variant] = body
        doc["load_avg_end"] = os.getloadavg()
        write_json(doc, args.json)  # after each variant: a long run keeps what it finished
        print(format_table(variant, body))
        for name, t in body["targets"].items():
            print(f"  target {name}: {t['value']} ({t['target']}): {'met' if t['met'] else 'MISSED'}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
