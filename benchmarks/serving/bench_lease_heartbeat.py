#!/usr/bin/env python3
"""What delays a lease heartbeat (issue 22): with N running requests on one replica, the time of one
usage-record round made the old way (one Redis round trip per request, which the heartbeat used to
wait behind), the same round pipelined (Settlements.record_progress now, on its own thread), and one
heartbeat (Settlements.beat: every lease in one round trip). Under no load, and beside busy threads
of the same process as an engine step makes them (pure Python; small torch ops). Prints a table,
writes JSON.

    .venv/bin/python -m benchmarks.serving.bench_lease_heartbeat --json docs/benchmarks/lease-heartbeat-cpu.json

Starts its own redis-server (loopback: the round trips are the cheapest they get).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch

from server.api.auth import Settlements
from server.bench.artifacts import write_json
from server.embedded_redis.server import EmbeddedRedis
from tenants import Limiter, TenantStore, UsageLog


def _python_burner(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(10_000):
            x += i


def _torch_burner(stop: threading.Event) -> None:
    a = torch.randn(64, 64)
    while not stop.is_set():
        a = torch.tanh(a @ a) * 0.5  # small ops: the GIL is taken and dropped often, as in an engine step


LOADS: dict[str, list[Callable[[threading.Event], None]]] = {
    "idle": [], "python thread": [_python_burner], "torch thread": [_torch_burner],
    "2 torch + python threads": [_torch_burner, _torch_burner, _python_burner]}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(client: redis.Redis, running: int, load: str, rounds: int) -> dict:
    store, limiter, usage = TenantStore(client), Limiter(client, lease_seconds=10.0), UsageLog(client)
    tenant = store.ensure(f"bench-{running}-{len(load)}-{time.monotonic_ns()}")
    settlements = Settlements(limiter, usage)
    delivered = [0] * running
    for i in range(running):
        admission = limiter.admit(tenant, f"r{i}", 1)
        settlements.open(tenant, admission, 3)
        settlements.follow(admission, lambda i=i: delivered[i])
    stop = threading.Event()
    burners = [threading.Thread(target=b, args=(stop,), daemon=True) for b in LOADS[load]]
    for b in burners:
        b.start()
    serial, pipelined, beat = [], [], []
    try:
        time.sleep(0.2)
        for _ in range(rounds):
            # The old round: one usage script per running request, one after another.
            serial.append(_timed(lambda: [usage.record(tenant, 0, 1, requests=0) for _ in range(running)]))
            for i in range(running):
                delivered[i] += 1
            pipelined.append(_timed(settlements.record_progress))
            beat.append(_timed(settlements.beat))
    finally:
        stop.set()
        for b in burners:
            b.join()
    ms = lambda xs, f: round(f(xs) * 1000, 1)  # noqa: E731
    return {"running": running, "load": load, "rounds": rounds,
            "serial_round_ms_p50": ms(serial, statistics.median), "serial_round_ms_max": ms(serial, max),
            "pipelined_round_ms_p50": ms(pipelined, statistics.median), "pipelined_round_ms_max": ms(pipelined, max),
            "beat_ms_p50": ms(beat, statistics.median), "beat_ms_max": ms(beat, max),
            # A beat used to wait for a whole record round; now it waits for nothing but itself.
            "old_beat_delay_ms_max": ms([s + b for s, b in zip(serial, beat)], max),
            "new_beat_delay_ms_max": ms(beat, max)}


def table(rows: list[dict]) -> str:
    head = ("running", "load", "serial round p50/max ms", "pipelined round p50/max ms", "beat p50/max ms",
            "old beat delay max ms", "new beat delay max ms")
    lines = [head] + [(str(r["running"]), r["load"], f"{r['serial_round_ms_p50']} / {r['serial_round_ms_max']}",
                       f"{r['pipelined_round_ms_p50']} / {r['pipelined_round_ms_max']}",
                       f"{r['beat_ms_p50']} / {r['beat_ms_max']}", str(r["old_beat_delay_ms_max"]),
                       str(r["new_beat_delay_ms_max"])) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_lease_heartbeat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", default="48,200,1000", help="running requests per case (default 48,200,1000)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per case (default 5)")
    p.add_argument("--json", default=None, help="write the report here (default: print only)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with EmbeddedRedis.start(Path(tempfile.mkdtemp(prefix="bench-lease-"))) as server:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        for running in (int(n) for n in args.running.split(",")):
            for load in LOADS:
                rows.append(measure(client, running, load, args.rounds))
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        client.close()
    print(table(rows))
    report = {"rows": rows, "load_average": os.getloadavg(),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "python": platform.python_version(), "torch": torch.__version__}}
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
