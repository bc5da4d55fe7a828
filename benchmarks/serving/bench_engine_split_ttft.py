#!/usr/bin/env python3
"""The engine-core process's IPC cost (issue 35's target: a 1-token request's TTFT over HTTP at most
2 ms above the in-process server's). Two real `loraplex serve` processes on the tiny random model, one
per --engine-process mode, on one redis-server (their own databases), take turns: each round sends one
streamed 1-token completion to each, in alternating order, and times its first SSE event. Prints a
table, writes JSON (with the CPU model and the load average: the difference is small beside a busy
machine's noise).

    .venv/bin/python -m benchmarks.serving.bench_engine_split_ttft --json docs/benchmarks/engine-split-ttft-cpu.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from benchmarks.profile.cpu_model import cpu_model
from server.bench.artifacts import write_json
from server.bench.server_proc import ServerProcess, provision
from server.demo import make_base_model
from server.embedded_redis.server import EmbeddedRedis

MODES = ("in-process", "separate")


def _ttft(client: httpx.Client, key: str, model: str) -> float:
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():  # read to the end: the next request finds the server idle
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no event")
    return first


def _summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))], "mean_ms": statistics.fmean(ms),
            "min_ms": ms[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="split-ttft-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        model_dir = make_base_model(work / "model", "llama", hidden_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2, intermediate_size=128)
        redis_server = EmbeddedRedis.start(work / "redis")
        stack.callback(redis_server.stop)
        servers = {}
        for db, mode in enumerate(MODES):
            srv = stack.enter_context(ServerProcess(
                work / mode, work / f"{mode}.log", model_dir=model_dir,
                serve_args=["--redis-url", redis_server.url_for(db + 2), "--device", "cpu", "--kv-cache-blocks", "64",
                            "--max-model-len", "512", "--engine-process", mode]))
            keys, base = provision(srv.url, srv.admin_token, ["bench"], {})
            client = stack.enter_context(httpx.Client(base_url=srv.url, timeout=30))
            servers[mode] = (client, keys["bench"], base)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.warmup + args.rounds):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                t = _ttft(*servers[mode]) * 1000
                if i >= args.warmup:
                    times[mode].append(t)
    doc = {"cpu": cpu_model(), "load_average": os.getloadavg(), "rounds": args.rounds,
           "modes": {m: _summary(times[m]) for m in MODES}}
    doc["separate_minus_in_process_median_ms"] = (doc["modes"]["separate"]["median_ms"]
                                                  - doc["modes"]["in-process"]["median_ms"])
    print(f"cpu: {doc['cpu']}; load average: {' '.join(f'{x:.2f}' for x in doc['load_average'])}")
    print(f"{'mode':<12}{'median ms':>11}{'p90 ms':>9}{'mean ms':>9}{'min ms':>9}")
    for mode, s in doc["modes"].items():
        print(f"{mode:<12}{s['median_ms']:>11.2f}{s['p90_ms']:>9.2f}{s['mean_ms']:>9.2f}{s['min_ms']:>9.2f}")
    print(f"separate - in-process (median): {doc['separate_minus_in_process_median_ms']:+.2f} ms (target <= +2 ms)")
    if args.json:
        write_json(doc, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
