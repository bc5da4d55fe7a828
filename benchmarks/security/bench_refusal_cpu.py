"""The front end's CPU time per refused request of bench_abuse's body attacks (issue 35): a 15 MB
token-id body from an open tenant and from one over its quota, /detokenize with 2^20 ids, and 64
echoed context-length prompts with logprobs 20, each sent `--requests` times one after another from
one client to `loraplex serve` on the demo model. The front end is the serve process (the engine core
is a process of its own); its CPU time is the kernel's per-thread count (schedstat), summed over its
threads, so it reads the same on a machine other sessions load, where bench_abuse's ITL ratios do not.

    .venv/bin/python -m benchmarks.security.bench_refusal_cpu --json bench-out/refusal_cpu.json
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.profile import thread_times
from benchmarks.security.abuse import _attacks
from benchmarks.security.victim_harness import client, new_tenant, victim_server
from server.bench.artifacts import write_json

ATTACKS = ("huge_token_body", "huge_body_over_quota", "detokenize_2e20_ids", "logprob_echo_200mb")
WARMUP = 3


def _cpu_s(pid: int) -> float:
    return sum(t[0] for t in thread_times.snapshot(pid).values()) / 1e9


def _measure(pid: int, c: httpx.Client, path: str, body: bytes, requests: int) -> dict:
    statuses: Counter = Counter()

    def post() -> None:
        try:
            statuses[str(c.post(path, content=body).status_code)] += 1
        except httpx.HTTPError as e:
            statuses[type(e).__name__] += 1

    for _ in range(WARMUP):
        post()
    statuses.clear()
    cpu, wall = _cpu_s(pid), time.monotonic()
    for _ in range(requests):
        post()
    cpu, wall = _cpu_s(pid) - cpu, time.monotonic() - wall
    return {"requests": requests, "statuses": dict(statuses), "body_bytes": len(body),
            "front_end_cpu_ms_per_request": round(cpu * 1000 / requests, 3),
            "wall_ms_per_request": round(wall * 1000 / requests, 3)}


def run(pid: int, target, requests: int, only: list[str]) -> dict:
    tag = str(int(time.time() * 1000))[-8:]
    keys = {"open": new_tenant(target, f"open-{tag}", {}),
            "limited": new_tenant(target, f"limited-{tag}", {"requests_per_minute": 1})}
    with client(target, keys["limited"]) as c:  # spend its one request: its bodies are then refused unread
        c.post("/v1/completions", json={"model": target.model, "prompt": "hi", "max_tokens": 1})
    attacks = _attacks(target)
    results = {}
    for name in only:
        attack = attacks[name]
        with client(target, keys[attack.tenants[0]]) as c:
            c.headers["Content-Type"] = "application/json"
            results[name] = _measure(pid, c, attack.path, attack.body, requests)
    return results


def table(results: dict) -> str:
    rows = [("attack", "body MB", "statuses", "front-end CPU ms/request", "wall ms/request")]
    for name, r in results.items():
        rows.append((name, f"{r['body_bytes'] / 1e6:.2f}", json.dumps(r["statuses"]),
                     str(r["front_end_cpu_ms_per_request"]), str(r["wall_ms_per_request"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_refusal_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default="bench-out/refusal-cpu", help="demo model, Redis data, server log")
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--requests", type=int, default=40, help="requests per attack, after 3 unmeasured (default 40)")
    p.add_argument("--only", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)}")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    only = args.only.split(",")
    unknown = set(only) - set(ATTACKS)
    if unknown:
        p.error(f"--only: unknown attack(s) {sorted(unknown)}")
    with victim_server(Path(args.work_dir), args.model, [], pin=False) as (srv, target, _):
        results = run(srv.proc.pid, target, args.requests, only)
    print(table(results))
    if args.json:
        write_json({"requests_per_attack": args.requests, "attacks": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
