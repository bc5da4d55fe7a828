#!/usr/bin/env python3
"""--data-parallel-size 2 against one engine core, over HTTP, at 32 adapters (issue 39's DP target).

Four real servers on the tiny random llama (a larger one without --quick), one redis-server (a
database each), all with the engine side and the front end on every core of the machine
(benchmarks.serving.shared_cores_serve):

  one core    --data-parallel-size 1: one engine core on both cores, torch threads 2, --max-loras 2S
  one core t1 the same with torch threads 1 (what a 2-thread engine loses on a busy machine: its
              threads wait for each other whenever one is descheduled)
  dp2         --data-parallel-size 2 --data-parallel-routing affinity: one core and S slots each
  dp2 rr      the same with --data-parallel-routing round-robin

(S = --slots; the same slot memory in all three.) Each round draws a trace of --requests requests over
32 adapters with Zipf(1.0) popularity and sends it to every server in turn, in a rotating order, with
--concurrency requests in flight (closed loop, non-streamed, greedy, ignore_eos). Per server and round:
completion tokens per second over the trace's wall time, and the device hit rate of the round (slot
acquisitions that found the adapter resident, from /admin/engine's slots hits and misses). The
throughput ratios are paired within rounds; the rows are the medians. The machine is shared with other
work: its CPU model and load average at start and end are in the JSON.

    .venv/bin/python -m benchmarks.serving.data_parallel --json docs/benchmarks/data-parallel-cpu.json
    .venv/bin/python -m benchmarks.serving.data_parallel --quick --json /tmp/dp.json
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.profile.cpu_model import cpu_model
from server.bench.artifacts import write_json
from server.bench.server_proc import ServerProcess, provision
from server.demo import make_adapter, make_base_model
from server.embedded_redis.server import EmbeddedRedis

ADAPTERS = 32
SERVERS = {  # name -> (data parallel size, routing, torch threads per engine core)
    "one core": (1, "affinity", 2),
    "one core t1": (1, "affinity", 1),
    "dp2": (2, "affinity", 1),
    "dp2 rr": (2, "round-robin", 1),
}
BASELINE = "one core"


@dataclass(frozen=True)
class Settings:
    rounds: int = 5
    requests: int = 160
    concurrency: int = 16
    max_tokens: int = 32
    prompt_len: int = 32
    slots: int = 4  # per engine core of dp2; the one-core server gets twice as many
    hidden: int = 256
    layers: int = 4
    seed: int = 0


QUICK = Settings(rounds=2, requests=64, concurrency=8, max_tokens=16, prompt_len=16, hidden=128, layers=2)


def zipf_trace(settings: Settings, round_index: int) -> list[tuple[str, list[int]]]:
    """(adapter name, prompt ids) per request: adapter k drawn with weight 1 / (k + 1)."""
    rng = random.Random(settings.seed * 1000 + round_index)
    names = [f"a{k}" for k in range(ADAPTERS)]
    weights = [1 / (k + 1) for k in range(ADAPTERS)]
    return [(rng.choices(names, weights)[0], [rng.randrange(5, 500) for _ in range(settings.prompt_len)])
            for _ in range(settings.requests)]


def _slot_counts(client: httpx.Client, admin: dict) -> tuple[int, int]:
    slots = client.get("/admin/engine", headers=admin).raise_for_status().json()["slots"]
    return slots["hits"], slots["misses"]


def run_trace(client: httpx.Client, key: str, admin: dict, trace, settings: Settings) -> dict:
    headers = {"Authorization": f"Bearer {key}"}

    def one(job) -> int:
        model, prompt = job
        r = client.post("/v1/completions", headers=headers, json={
            "model": model, "prompt": prompt, "max_tokens": settings.max_tokens, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    hits0, misses0 = _slot_counts(client, admin)
    start = time.perf_counter()
    with ThreadPoolExecutor(settings.concurrency) as pool:
        tokens = sum(pool.map(one, trace))
    wall = time.perf_counter() - start
    hits, misses = _slot_counts(client, admin)
    hits, misses = hits - hits0, misses - misses0
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens,
            "device_hit_rate": hits / (hits + misses) if hits + misses else None, "device_loads": misses}


def _server(stack: ExitStack, work: Path, name: str, model_dir: Path, redis_url: str, settings: Settings,
            adapters: dict) -> tuple[httpx.Client, str, dict]:
    size, routing, threads = SERVERS[name]
    slug = name.replace(" ", "-")
    srv = ServerProcess(work / slug, work / f"{slug}.log", model_dir=model_dir, serve_args=[
        "--redis-url", redis_url, "--device", "cpu", "--dtype", "float32", "--engine-process", "separate",
        "--data-parallel-size", str(size), *(("--data-parallel-routing", routing) if size > 1 else ()),
        "--cpu-threads", str(threads),
        "--max-loras", str(settings.slots * (2 // size)), "--max-lora-rank", "16", "--max-model-len", "256",
        "--kv-cache-blocks", str(64 * 2 // size), "--max-num-seqs", str(settings.concurrency)])
    # The placement the flags cannot name: both sides on every core (see shared_cores_serve).
    launcher = [sys.executable, "-m", "benchmarks.serving.shared_cores_serve", "serve"]
    srv.argv = launcher + srv.argv[srv.argv.index("serve") + 1:]
    stack.enter_context(srv)
    keys, _ = provision(srv.url, srv.admin_token, ["bench"], {n: ("bench", d) for n, d in adapters.items()})
    client = stack.enter_context(httpx.Client(base_url=srv.url, timeout=300))
    return client, keys["bench"], {"Authorization": f"Bearer {srv.admin_token}"}


def run(settings: Settings, work: Path, log=print) -> dict:
    load_start = os.getloadavg()
    model_dir = make_base_model(work / "model", "llama", hidden_size=settings.hidden, num_layers=settings.layers,
                                num_heads=4, num_kv_heads=2, intermediate_size=settings.hidden * 2)
    adapters = {f"a{k}": make_adapter(model_dir, work / f"a{k}", r=8, lora_alpha=16, seed=100 + k)
                for k in range(ADAPTERS)}
    rounds = []
    with ExitStack() as stack:
        redis_server = EmbeddedRedis.start(work / "redis")
        stack.callback(redis_server.stop)
        servers = {name: _server(stack, work, name, model_dir, redis_server.url_for(3 + i), settings, adapters)
                   for i, name in enumerate(SERVERS)}
        warm = zipf_trace(settings, -1)[: settings.concurrency]
        for name, (client, key, admin) in servers.items():
            run_trace(client, key, admin, warm, settings)
        names = list(SERVERS)
        for r in range(settings.rounds):
            trace = zipf_trace(settings, r)
            order = names[r % len(names):] + names[: r % len(names)]
            row = {}
            for name in order:
                row[name] = run_trace(*servers[name], trace, settings)
                log(f"round {r}: {name:12s} {row[name]['tokens_per_s']:8.1f} tok/s  "
                    f"device hit rate {row[name]['device_hit_rate']}")
            rounds.append({"order": order, **row})
    return summarize(rounds, settings, load_start)


def summarize(rounds: list[dict], settings: Settings, load_start: tuple[float, float, float]) -> dict:
    """The report: each server's median throughput, its ratio to the baseline paired within rounds, and its
    median device hit rate; with the machine (a shared one: its load average at start and end)."""
    summary = {}
    for name in SERVERS:
        paired = [rd[name]["tokens_per_s"] / rd[BASELINE]["tokens_per_s"] for rd in rounds]
        summary[name] = {"tokens_per_s": statistics.median(rd[name]["tokens_per_s"] for rd in rounds),
                         "over_one_core": statistics.median(paired), "over_one_core_per_round": paired,
                         "device_hit_rate": statistics.median(rd[name]["device_hit_rate"] or 0.0 for rd in rounds)}
    return {"machine": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "load_average_start": load_start,
                        "load_average_end": os.getloadavg(), "shared": "yes: other sessions ran on it"},
            "settings": asdict(settings),
            "servers": {n: {"data_parallel_size": size, "routing": routing, "torch_threads": threads}
                        for n, (size, routing, threads) in SERVERS.items()},
            "rounds": rounds, "summary": summary}


def format_table(doc: dict) -> str:
    lines = [f"{'server':12s} {'tok/s':>9s} {'x one core':>11s} {'device hit rate':>16s}"]
    for name, row in doc["summary"].items():
        lines.append(f"{name:12s} {row['tokens_per_s']:9.1f} {row['over_one_core']:10.2f}x "
                     f"{row['device_hit_rate']:16.2f}")
    m = doc["machine"]
    lines.append(f"{m['cpu']}, {m['cores']} cores, load average {m['load_average_start'][0]:.1f} -> "
                 f"{m['load_average_end'][0]:.1f} (a shared machine)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model and trace, two rounds")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    settings = QUICK if args.quick else Settings()
    if args.rounds is not None:
        settings = Settings(**{**asdict(settings), "rounds": args.rounds})
    with tempfile.TemporaryDirectory(prefix="dp-bench-") as tmp:
        doc = run(settings, Path(tmp))
    print(format_table(doc))
    if args.json is not None:
        write_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
