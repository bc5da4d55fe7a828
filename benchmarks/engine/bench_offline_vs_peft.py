#!/usr/bin/env python3
"""Wall time of one mixed-adapter `LLM.generate` vs the same requests through transformers + peft one by one.

A first ratio for the engine (the multi-tenant HTTP benchmark is benchmarks/serving/bench.py).
Prints a table and writes JSON.

    .venv/bin/python -m benchmarks.engine.bench_offline_vs_peft --requests 64 --json bench-out/offline.json
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from server.demo import ensure_demo
from server.engine import LLM, SamplingParams


def peft_one_by_one(model_dir, adapters: dict, prompts, names, max_tokens) -> tuple[float, list[list[int]]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    first, *rest = adapters
    model = PeftModel.from_pretrained(base, adapters[first], adapter_name=first)
    for name in rest:
        model.load_adapter(adapters[name], adapter_name=name)
    outs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt, name in zip(prompts, names):
            ids = torch.tensor([prompt])
            kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=2)
            if name is None:
                with model.disable_adapter():
                    out = model.generate(**kwargs)
            else:
                model.set_adapter(name)
                out = model.generate(**kwargs)
            outs.append(out[0, len(prompt):].tolist())
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--demo-dir", default=None)
    ap.add_argument("--json", default="bench-out/offline_vs_peft.json")
    args = ap.parse_args()
    demo = ensure_demo(Path(args.demo_dir or tempfile.mkdtemp(prefix="loraplex-demo-")))
    rng = random.Random(0)
    choices = [None, *demo.adapters]
    names = [choices[i % len(choices)] for i in range(args.requests)]
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 64))] for _ in names]
    llm = LLM(demo.model_dir, device="cpu", dtype="float32", max_loras=8, kv_cache_blocks=2048, max_model_len=512)
    for name, path in demo.adapters.items():
        llm.add_adapter(name, path)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, adapters=names)
    engine_s = time.perf_counter() - start
    peft_s, ref = peft_one_by_one(demo.model_dir, demo.adapters, prompts, names, args.max_tokens)
    matches = sum(o.token_ids == r for o, r in zip(outs, ref))
    row = {
        "requests": args.requests, "max_tokens": args.max_tokens, "adapters": len(demo.adapters),
        "loraplex_s": engine_s, "peft_one_by_one_s": peft_s, "speedup": peft_s / engine_s,
        "greedy_matches": matches, "torch_threads": torch.get_num_threads(),
    }
    print(f"{'requests':>8} {'loraplex s':>11} {'peft s':>8} {'speedup':>8} {'match':>7}")
    print(f"{args.requests:>8} {engine_s:>11.2f} {peft_s:>8.2f} {row['speedup']:>7.1f}x {matches:>4}/{args.requests}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
