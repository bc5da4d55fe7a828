#!/usr/bin/env python3
"""Hostile-schema flood (issue 24): a victim tenant's p99 inter-token latency while another tenant
floods the server with distinct structured-output constraints (slow ones past the compile deadline,
then many small ones), against a quiet baseline. Prints a table, writes JSON.

    .venv/bin/python -m benchmarks.security.bench_schema_flood --pin --serve-arg=--max-grammar-compile-ms=1000 \\
        --json docs/benchmarks/schema-flood-cpu.json

Starts `loraplex serve` on the demo model (or --model) with an embedded Redis under --work-dir.
With --pin (Linux, 2+ cores) the server and its children run on CPU 0 and the attacker's processes,
the victim client and the /health poller on the other CPUs. Target: p99 ITL moves <= 10%.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import httpx

from benchmarks.security import abuse, schema_flood
from benchmarks.security.victim_harness import (add_victim_server_args, check_victim_server_args,
                                                profile_text, victim_server)
from server.bench.artifacts import write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_schema_flood", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_victim_server_args(p, "bench-out/schema-flood", "--max-grammar-compile-ms=2000")
    p.add_argument("--loops", type=int, default=4, help="attacker request loops, each a process (default 4)")
    p.add_argument("--regex-groups", type=int, default=1000,
                   help="`(a|b)?` groups of each slow_schemas regex (default 1000: 6 kB, under the default "
                        "--max-schema-bytes, and over 15 s of CPU time to compile on 2 cores)")
    p.add_argument("--attacker-concurrency", type=int, default=None,
                   help="the attacker tenant's max_concurrent_requests (default: unlimited)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_victim_server_args(parser, args)
    trace = Path(args.trace) if args.trace else None
    with victim_server(Path(args.work_dir), args.model, args.serve_arg, args.pin, args.pin_engine,
                       trace) as (srv, target, attacker_cpus):
        admin = {"Authorization": f"Bearer {srv.admin_token}"}
        quota = {} if args.attacker_concurrency is None else {"max_concurrent_requests": args.attacker_concurrency}
        load_before = os.getloadavg()
        report = schema_flood.run(target, args.phase_s, args.loops, attacker_cpus, args.regex_groups, quota,
                                  log=lambda s: print(s, file=sys.stderr, flush=True),
                                  profile=(srv.proc.pid, Path(args.profile)) if args.profile else None,
                                  attacker_nice=args.attacker_nice, trace=trace)
        engine = httpx.get(srv.url + "/admin/engine", headers=admin).json()["structured_output"]
    report["server_structured_output"] = engine
    report["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                         "python": platform.python_version(), "model": target.model,
                         "serve_args": args.serve_arg, "pinned": args.pin, "pinned_engine": args.pin_engine,
                         "attacker_nice": args.attacker_nice,
                         "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    print(abuse.table(report))
    print(profile_text(report))
    print(f"compiles {engine['compiles']}, compile timeouts {engine['compile_timeouts']}, "
          f"failures {engine['failures']}; target (p99 ITL <= x{schema_flood.ITL_TARGET_RATIO}) met: {report['met']}")
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
