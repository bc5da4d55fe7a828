#!/usr/bin/env python3
"""Output tokens per second with structured output: 32 concurrent requests, half of them under
a JSON-schema or regex constraint, against the same 32 all unconstrained, on the engine
(LLMEngine, no HTTP). Adapters and the base model are mixed in both runs. Rounds alternate
the two runs; the table gives the median round of each and their ratio, and JSON is written.

Every constraint is chosen to run to max_tokens (ignore_eos; arrays with many items), so both
runs generate the same number of tokens and the ratio is the cost of the masks alone:
one batch bitmask filled per step after the forward call, applied before sampling, and one matcher
advance per constrained token.

    .venv/bin/python -m benchmarks.engine.bench_structured --json docs/benchmarks/structured-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from server.demo import DEMO_MODEL, ensure_demo, make_base_model
from server.engine import LLM, SamplingParams, StructuredOutputsParams

SCHEMAS = [
    {"type": "array", "minItems": 200, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0},
                                         "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                         "kind": {"enum": ["a", "b", "c"]}},
        "required": ["id", "name", "kind"], "additionalProperties": False}},
    {"type": "array", "minItems": 200, "items": {"anyOf": [{"type": "number", "minimum": -5, "maximum": 5},
                                                           {"type": "boolean"}, {"type": "null"}]}},
]
REGEX = r"([a-z]{1,8} ){100,400}"


def constraint(i: int) -> StructuredOutputsParams:
    if i % 3 == 2:
        return StructuredOutputsParams(regex=REGEX)
    return StructuredOutputsParams(json=SCHEMAS[i % 2])


def requests(n: int, constrained: bool, max_tokens: int, vocab: int):
    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))]
        spec = constraint(i) if constrained and i % 2 == 0 else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True,
                                structured_outputs=spec)
        out.append((prompt, params))
    return out


def run(llm: LLM, reqs, adapters) -> dict:
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in reqs], [s for _, s in reqs], adapters=adapters)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.token_ids) for o in outs)
    reasons = [o.finish_reason for o in outs]
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens, "tok_s": tokens / seconds,
            "tok_per_cpu_s": tokens / cpu, "finished_by_grammar": sum(r == "stop" for r in reasons)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests (default 32)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the two runs (default 5)")
    ap.add_argument("--vocab", type=int, default=512,
                    help="vocabulary of the random-weight demo-shaped model (default 512, the demo's)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        demo = ensure_demo(Path(tmp) / "demo")
        model_dir = demo.model_dir
        if args.vocab != 512:
            model_dir = make_base_model(Path(tmp) / "model", vocab_size=args.vocab, **DEMO_MODEL)
        llm = LLM(model_dir, device="cpu", max_loras=4, max_num_seqs=64, max_model_len=1024)
        names = list(demo.adapters)[:3]
        for name in names:
            llm.add_adapter(name, demo.adapters[name])
        vocab = llm.engine.model_config.vocab_size
        adapters = [(names + [None])[i % (len(names) + 1)] for i in range(args.requests)]
        plain = requests(args.requests, False, args.max_tokens, vocab)
        mixed = requests(args.requests, True, args.max_tokens, vocab)
        run(llm, mixed[:4], adapters[:4])  # warm-up, and every grammar compiled (cached) before timing
        rounds = {"unconstrained": [], "half_constrained": []}
        for r in range(args.rounds):
            order = [("unconstrained", plain), ("half_constrained", mixed)]
            for name, reqs in (order if r % 2 == 0 else order[::-1]):
                rounds[name].append(run(llm, reqs, adapters))
    # Wall-clock tok/s moves with whatever else the machine runs; tokens per CPU-second of this
    # process (all its threads) much less, so both are reported, each as paired per-round ratios.
    med = {name: statistics.median(x["tok_s"] for x in rs) for name, rs in rounds.items()}
    med_cpu = {name: statistics.median(x["tok_per_cpu_s"] for x in rs) for name, rs in rounds.items()}
    pairs = list(zip(rounds["half_constrained"], rounds["unconstrained"]))
    ratio = statistics.median(c["tok_s"] / u["tok_s"] for c, u in pairs)
    ratio_cpu = statistics.median(c["tok_per_cpu_s"] / u["tok_per_cpu_s"] for c, u in pairs)
    print(f"{'run':<18} {'tok/s':>8} {'tok/cpu-s':>10}  rounds (tok/s)")
    for name, rs in rounds.items():
        per_round = ", ".join(f"{x['tok_s']:.1f}" for x in rs)
        print(f"{name:<18} {med[name]:>8.1f} {med_cpu[name]:>10.1f}  {per_round}")
    print(f"half constrained / unconstrained, median of paired rounds: wall {ratio:.3f}, CPU {ratio_cpu:.3f}")
    result = {"requests": args.requests, "max_tokens": args.max_tokens, "vocab": vocab,
              "model": "demo-shaped random weights (" + ", ".join(f"{k}={v}" for k, v in DEMO_MODEL.items()) + ")",
              "adapters": names, "rounds": rounds, "median_tok_s": med,
              "median_tok_per_cpu_s": med_cpu, "ratio_wall": ratio, "ratio_cpu": ratio_cpu,
              "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
