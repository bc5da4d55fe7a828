#!/usr/bin/env python3
"""Fair under abuse (issue 22): a victim tenant's inter-token latency and /health latency while
another tenant runs each attack in turn, against a quiet baseline. Prints a table, writes JSON.

    .venv/bin/python -m benchmarks.security.bench_abuse --json docs/benchmarks/abuse-cpu.json
    .venv/bin/python -m benchmarks.security.bench_abuse --phase-s 5 --only huge_token_body,tokenize_flood

Starts `loraplex serve` on the demo model (or --model) with an embedded Redis under --work-dir.
With --pin (Linux, 2+ cores) the server runs on CPU 0 and the attacker's processes, the victim
client and the /health poller on the other CPUs. The report ends with the server's lease health
(leases lost, the longest a running request's lease went unrenewed). Target: each attack moves the
victim's p99 ITL by at most 20% and /health p99 stays <= 100 ms.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import httpx

from benchmarks.security import abuse
from benchmarks.security.victim_harness import (add_victim_server_args, check_victim_server_args,
                                                profile_text, victim_server)
from server.bench.artifacts import write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_abuse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_victim_server_args(p, "bench-out/abuse", "--max-num-batched-tokens=256")
    p.add_argument("--only", default=None, help="comma-separated attacks to run (default: all)")
    return p


def _lease_health(metrics: str) -> dict:
    """The server's lease counters from its /metrics text."""
    values = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name in ("loraplex_leases_lost", "loraplex_lease_heartbeat_longest_gap_seconds"):
            values[name] = float(value)
    return {"lost": values.get("loraplex_leases_lost"),
            "longest_heartbeat_gap_s": values.get("loraplex_lease_heartbeat_longest_gap_seconds")}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_victim_server_args(parser, args)
    with victim_server(Path(args.work_dir), args.model, args.serve_arg, args.pin) as (srv, target, attacker_cpus):
        admin = {"Authorization": f"Bearer {srv.admin_token}"}
        load_before = os.getloadavg()
        report = abuse.run(target, args.phase_s, args.only.split(",") if args.only else None,
                           log=lambda s: print(s, file=sys.stderr, flush=True), attacker_cpus=attacker_cpus,
                           profile=(srv.proc.pid, Path(args.profile)) if args.profile else None)
        report["leases"] = _lease_health(httpx.get(srv.url + "/metrics", headers=admin).text)
    report["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                         "python": platform.python_version(), "model": target.model,
                         "max_model_len": target.max_model_len, "max_logprob_entries": target.max_logprob_entries,
                         "serve_args": args.serve_arg, "pinned": args.pin,
                         "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    print(abuse.table(report))
    print(profile_text(report))
    print(f"target met: {report['met']}; leases lost {report['leases']['lost']}, longest heartbeat gap "
          f"{report['leases']['longest_heartbeat_gap_s']} s")
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
