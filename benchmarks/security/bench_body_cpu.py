"""CPU time of the front end's per-body work on bench_abuse's attack bodies (issue 35): the body read,
parsed and validated as the completions, /tokenize and /detokenize routes do (server.api.body), with
no server. Each body is handled `--repeat` times on this thread; the table gives the median and the
longest CPU time per body, and the longest single call that held the GIL throughout (the parse or the
validation), which is what an event loop on another thread waits for.

    .venv/bin/python -m benchmarks.security.bench_body_cpu --json bench-out/body_cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from server.api.body import BASE_VALUES, parse_json_object, parse_model
from server.api.errors import APIError
from server.api.openai_requests import CompletionRequest, DetokenizeRequest, TokenizeRequest

MAX_MODEL_LEN = 2048  # bench_abuse's server
MAX_BATCH_PROMPTS = 64


def _bodies(model: str) -> dict[str, tuple[type, int, bytes]]:
    limit = MAX_MODEL_LEN
    completion_values = MAX_BATCH_PROMPTS * limit + BASE_VALUES
    huge = ('{"model":"%s","prompt":[%s],"max_tokens":1}' % (model, ",".join(["1234"] * 3_000_000))).encode()
    heavy = {"model": model, "prompt": [[5] * (limit - 2)] * 64, "max_tokens": 1, "echo": True,
             "logprobs": 20, "prompt_logprobs": 20}
    text = ("hello world " * limit)[:limit - 8]
    return {
        "huge_token_body": (CompletionRequest, completion_values, huge),
        "logprob_echo_200mb": (CompletionRequest, completion_values, json.dumps(heavy).encode()),
        "tokenize_flood": (TokenizeRequest, BASE_VALUES, json.dumps({"model": model, "prompt": text}).encode()),
        "detokenize_flood": (DetokenizeRequest, limit + BASE_VALUES,
                             json.dumps({"model": model, "tokens": [7] * limit}).encode()),
    }


def _once(cls: type, max_values: int, raw: bytes) -> tuple[float, float, str]:
    """(CPU seconds in all, longest of parse and validation, outcome)."""
    t0 = time.thread_time()
    try:
        body = parse_json_object(raw, max_values)
    except APIError as e:
        return time.thread_time() - t0, time.thread_time() - t0, f"{e.status} {e.code}"
    t1 = time.thread_time()
    try:
        parse_model(cls, body)
        outcome = "valid"
    except APIError as e:
        outcome = f"{e.status} {e.code}"
    t2 = time.thread_time()
    return t2 - t0, max(t1 - t0, t2 - t1), outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = {}
    print(f"{'body':<20} {'bytes':>10} {'outcome':<22} {'median ms':>10} {'max ms':>8} {'longest piece ms':>17}")
    for name, (cls, max_values, raw) in _bodies("base").items():
        runs = [_once(cls, max_values, raw) for _ in range(args.repeat)]
        total = [r[0] * 1e3 for r in runs]
        piece = [r[1] * 1e3 for r in runs]
        rows[name] = {"bytes": len(raw), "outcome": runs[-1][2], "median_ms": statistics.median(total),
                      "max_ms": max(total), "longest_piece_median_ms": statistics.median(piece)}
        print(f"{name:<20} {len(raw):>10} {runs[-1][2]:<22} {statistics.median(total):>10.2f} {max(total):>8.2f} "
              f"{statistics.median(piece):>17.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"repeat": args.repeat, "bodies": rows}, indent=1))


if __name__ == "__main__":
    main()
