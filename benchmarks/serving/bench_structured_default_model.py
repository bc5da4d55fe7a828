"""The structured workload's validity part on the default model (issue 42's target): every schema of
the suite (server.bench.schema_suite) sent to SmolLM2-135M-Instruct through a `loraplex serve`
child, at each temperature given, and the outputs counted: finished with stop, valid JSON, valid
under the schema (formats checked). Each prompt is a chat turn asking for a JSON value of that
schema, so the model writes the kind of text a user's request gets (names, sentences), which is
where string escapes matter. Every invalid output is kept in the JSON with its schema and why.

    .venv/bin/python -m benchmarks.serving.bench_structured_default_model \\
        --json docs/benchmarks/structured-default-model.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from server.bench.environment import machine_state
from server.bench.real_workload import real_model_dir
from server.bench.schema_suite import load_suite
from server.bench.server_proc import bench_server
from server.bench.structured import VALIDITY_MAX_TOKENS, _validity, _validity_summary
from server.bench.workload import BenchRequest

TENANT = "t0"


def _prompts(model_dir: Path, suite: list[tuple[str, dict]]) -> list[BenchRequest]:
    """One base-model request per schema: the schema in a user turn, through the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i, (_, schema) in enumerate(suite):
        ask = ("Reply with one JSON value, filled with realistic data, that matches this JSON schema:\n"
               + json.dumps(schema))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=True,
                                            add_generation_prompt=True, return_dict=True)["input_ids"]
        out.append(BenchRequest(i, 0.0, None, TENANT, tuple(ids), VALIDITY_MAX_TOKENS))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1)")
    p.add_argument("--samples", type=int, default=1, help="requests per schema and temperature (seeds differ)")
    p.add_argument("--first-sample", type=int, default=0,
                   help="the first sample's index (its seeds): another run's samples continue a finished one's")
    p.add_argument("--schemas", type=int, default=None, help="the suite's first N schemas (default all)")
    p.add_argument("--only", default=None, metavar="NAME[,NAME...]",
                   help="only these schemas of the suite (core/person, generated/gen-003, ...)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cpu-threads", default="auto")
    p.add_argument("--work-dir", default="bench-out")
    p.add_argument("--json", default="bench-out/structured-default-model.json")
    args = p.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    suite = load_suite()[:args.schemas]
    if args.only:
        suite = [(name, schema) for name, schema in suite if name in args.only.split(",")]
    model_dir = real_model_dir(Path(args.work_dir), log)
    reqs = _prompts(model_dir, suite)
    serve = ["--device", "cpu", "--cpu-threads", args.cpu_threads, "--max-num-seqs", str(args.concurrency)]
    doc = {"workload": "structured (validity) on the default model", "model": "SmolLM2-135M-Instruct",
           "max_tokens": VALIDITY_MAX_TOKENS, "concurrency": args.concurrency, "samples": args.samples,
           "serve_args": serve, "runs": []}
    with bench_server(args.work_dir, model_dir, serve, reqs, {}, log) as (url, keys, base):
        doc["machine_before"] = machine_state(log)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            for sample in range(args.first_sample, args.first_sample + args.samples):
                # seeds differ per sample: _validity seeds request i with shift + i
                shift = sample * len(suite)
                t = time.perf_counter()
                outcomes = asyncio.run(_validity(url, keys, base, reqs, suite, args.concurrency, temperature,
                                                 seed_offset=shift))
                run = {"temperature": temperature, "sample": sample, **_validity_summary(outcomes),
                       "seconds": time.perf_counter() - t, "load_avg": os.getloadavg(),
                       "invalid": [asdict(o) for o in outcomes if o.finish_reason == "stop" and not o.valid],
                       "not_stop": [asdict(o) for o in outcomes if o.finish_reason != "stop"]}
                run.pop("by_model")
                doc["runs"].append(run)
                log(f"temperature {temperature} sample {sample}: {run['schemas']} schemas, {run['stop']} stop, "
                    f"{run['valid_json']} valid JSON, {run['valid']} valid under the schema, {run['length']} length, "
                    f"{run['errors']} errors ({run['seconds']:.0f} s)")
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
