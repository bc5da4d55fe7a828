#!/usr/bin/env python3
"""Speculative decoding (`--speculative-config`, ngram) against the plain engine, in paired rounds on
the real default model: decode tok/s, acceptance rate and mean accepted length.

Workloads (chat-templated, greedy, float32):
  grounded  server/bench/grounded_items.jsonl: quote, extract or edit text from the prompt, where
            prompt lookup finds the continuation;
  chat      the chat eval items (server/bench/eval_items.jsonl): short answers in the model's own
            words, where drafts are rarely proposed or accepted.
Each case is a workload at a batch size: batch 1 runs the items one at a time, batch B adds B items
at once. Both engines are built first; each round runs every case on both, alternating which goes
first, and checks the speculative engine's tokens equal the plain engine's. A request's decode is its
time from its first token to its last; decode tok/s is the tokens after the first over that time
(batch 1: summed over the items; batch B: the batch's span from its first first token to its last
token). The ratio is taken per round (the same load for both halves) and its median reported.

    .venv/bin/python -m benchmarks.engine.speculative --json docs/benchmarks/speculative-ngram-cpu.json

--temperature T samples without a seed (the engine's generator): the speculative engine's tokens then
keep the target's distribution (rejection sampling), not the plain engine's tokens, so no identity is
checked ("identical" is null). --json-answer constrains every answer to a JSON object with one string
field, {"answer": ...} (structured output: each verify position under its own grammar mask), greedy,
so the tokens are checked as without it.

--draft-self runs the draft_model method with the served model as its own draft: no smaller model with
the default model's vocabulary is installed, so this row shows the mechanism's overhead (every greedy
draft accepted, each costing a draft forward as large as the target's), not a speed-up to expect.
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

import torch

from benchmarks.profile.cpu_model import cpu_model
from server.bench.eval_items import load_items
from server.engine import LLM, SamplingParams, StructuredOutputsParams
from server.engine.scheduler import SpecDecodeStats

GROUNDED_PATH = Path(__file__).resolve().parents[2] / "server" / "bench" / "grounded_items.jsonl"
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def prompts(tokenizer, workload: str, n: int) -> list[list[int]]:
    if workload == "grounded":
        texts = [json.loads(line)["prompt"] for line in GROUNDED_PATH.read_text().splitlines() if line.strip()]
    else:
        items = load_items()
        texts = [items[i * len(items) // n].question for i in range(n)]  # spread over every kind
    texts = [texts[i % len(texts)] for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True,
                                          return_dict=True)["input_ids"] for t in texts]


JSON_ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
               "additionalProperties": False}


def sampling(max_tokens: int, temperature: float = 0.0, json_answer: bool = False) -> SamplingParams:
    structured = StructuredOutputsParams(json=JSON_ANSWER) if json_answer else None
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, structured_outputs=structured)


def run(llm: LLM, batches: list[list[list[int]]], params: SamplingParams) -> dict:
    """Every batch to completion; decode tokens and seconds, and the tokens per request."""
    engine = llm.engine
    tokens, seconds, outputs = 0, 0.0, []
    for b, batch in enumerate(batches):
        ids = [f"{b}-{i}" for i in range(len(batch))]
        for rid, prompt in zip(ids, batch):
            engine.add_request(rid, prompt, params, None)
        first: float | None = None
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.token_ids:
                    first = time.perf_counter()
                if out.finished:
                    final[out.request_id] = out
        seconds += time.perf_counter() - first
        outputs += [final[r].token_ids for r in ids]
        tokens += sum(len(final[r].token_ids) for r in ids) - len(ids)
    return {"decode_tokens": tokens, "decode_seconds": seconds, "outputs": outputs}


def spec_delta(before: SpecDecodeStats, after: SpecDecodeStats) -> SpecDecodeStats:
    k = len(after.accepted_per_position)
    pos = tuple(a - (before.accepted_per_position[j] if j < len(before.accepted_per_position) else 0)
                for j, a in enumerate(after.accepted_per_position[:k]))
    return SpecDecodeStats(after.method, after.num_drafts - before.num_drafts,
                           after.num_draft_tokens - before.num_draft_tokens,
                           after.num_accepted_tokens - before.num_accepted_tokens, pos,
                           after.skipped_steps - before.skipped_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the default model, converted)")
    ap.add_argument("--spec", default=json.dumps(DEFAULT_SPEC), help="the --speculative-config JSON")
    ap.add_argument("--draft-self", type=int, default=None, metavar="K",
                    help="instead of --spec: the draft_model method with the model as its own draft, K drafts")
    ap.add_argument("--cases", default="grounded:1,chat:1,grounded:8,chat:8,grounded:32,chat:32",
                    help="workload:batch, comma separated")
    ap.add_argument("--items", type=int, default=12, help="requests per batch-1 case")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-threads", type=int, default=1, help="torch threads (--device cpu)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the engine's GPU path (Triton kernels, decode and verify graphs)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: unseeded sampling (no identity check: the distribution is what is kept)")
    ap.add_argument("--json-answer", action="store_true", help='every answer a JSON object {"answer": string}')
    ap.add_argument("--json", default="bench-out/speculative-cpu.json")
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else default_model()
    spec = json.loads(args.spec)
    if args.draft_self is not None:
        spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": args.draft_self}
    opts = dict(device=args.device, dtype="float32", max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=1024)
    if args.device == "cpu":
        opts["cpu_threads"] = args.cpu_threads
    plain, specd = LLM(model_dir, **opts), LLM(model_dir, speculative_config=spec, **opts)
    cases = [(w, int(b)) for w, b in (c.split(":") for c in args.cases.split(","))]
    load_before = os.getloadavg()
    results = []
    for workload, batch in cases:
        n = args.items if batch == 1 else batch
        ps = prompts(plain.tokenizer, workload, n)
        batches = [[p] for p in ps] if batch == 1 else [ps]
        params = sampling(args.max_tokens, args.temperature, args.json_answer)
        warm = sampling(8, args.temperature, args.json_answer)
        run(plain, batches[:1], warm), run(specd, batches[:1], warm)  # warm-up
        rounds = []
        for r in range(args.rounds):
            before = specd.engine.stats().speculative
            order = [("plain", plain), ("spec", specd)] if r % 2 == 0 else [("spec", specd), ("plain", plain)]
            got = {name: run(llm, batches, params) for name, llm in order}
            stats = spec_delta(before, specd.engine.stats().speculative)
            same = got["plain"]["outputs"] == got["spec"]["outputs"] if params.greedy else None
            tps = {name: g["decode_tokens"] / g["decode_seconds"] for name, g in got.items()}
            rounds.append({"plain_tok_s": round(tps["plain"], 2), "spec_tok_s": round(tps["spec"], 2),
                           "ratio": round(tps["spec"] / tps["plain"], 3), "identical": same,
                           "decode_tokens": got["plain"]["decode_tokens"],
                           "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                           "num_accepted_tokens": stats.num_accepted_tokens,
                           "accepted_per_position": list(stats.accepted_per_position),
                           "skipped_steps": stats.skipped_steps,
                           "acceptance_rate": round(stats.acceptance_rate, 3),
                           "mean_accepted_length": round(stats.mean_accepted_length, 3),
                           "load_avg": [round(x, 2) for x in os.getloadavg()]})
            print(f"{workload:>9} b{batch:<3} round {r}: plain {tps['plain']:7.1f} spec {tps['spec']:7.1f} tok/s "
                  f"x{rounds[-1]['ratio']:.2f}  accept {stats.acceptance_rate:.2f} "
                  f"len {stats.mean_accepted_length:.2f} identical {same}", flush=True)
        results.append({"workload": workload, "batch": batch, "requests": n,
                        "median_ratio": round(statistics.median(r["ratio"] for r in rounds), 3),
                        "all_identical": all(r["identical"] for r in rounds) if params.greedy else None,
                        "rounds": rounds})
    print(f"\n{'workload':>9} {'batch':>5} {'ratio':>7} {'accept':>7} {'mean len':>9} identical")
    for c in results:
        last = c["rounds"][-1]
        print(f"{c['workload']:>9} {c['batch']:>5} {c['median_ratio']:>7.2f} {last['acceptance_rate']:>7.2f} "
              f"{last['mean_accepted_length']:>9.2f} {c['all_identical']}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": str(model_dir.name), "speculative_config": spec, "device": args.device, "cpu": cpu_model(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "cpu_threads": args.cpu_threads if args.device == "cpu" else None, "torch": torch.__version__,
        "machine": platform.machine(),
        "load_avg_before": [round(x, 2) for x in load_before], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "max_tokens": args.max_tokens, "temperature": args.temperature, "json_answer": args.json_answer,
        "rounds": args.rounds, "cases": results,
    }, indent=2) + "\n")
    print(f"wrote {out}")


def default_model() -> Path:
    from benchmarks.eval.eval_real_model import default_model_dir

    return default_model_dir(Path(tempfile.gettempdir()) / "loraplex-bench-speculative")


if __name__ == "__main__":
    main()
