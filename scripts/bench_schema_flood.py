#!/usr/bin/env python3
"""Hostile-schema flood (issue 24): a victim tenant's p99 inter-token latency while another tenant
floods the server with distinct structured-output constraints (slow ones past the compile deadline,
then many small ones), against a quiet baseline. Prints a table, writes JSON.

    .venv/bin/python scripts/bench_schema_flood.py --pin --serve-arg=--max-grammar-compile-ms=1000 \\
        --json docs/benchmarks/schema-flood-cpu.json

Starts `loraplex serve` on the demo model (or --model) with an embedded Redis under --work-dir.
With --pin (Linux, 2+ cores) the server and its children run on CPU 0 and the attacker's processes,
the victim client and the /health poller on the other CPUs. Target: p99 ITL moves <= 10%.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

# Runnable as a plain script from a checkout, without installing the project.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from server.bench import abuse, schema_flood  # noqa: E402
from server.bench.server_profile import can_profile  # noqa: E402
from server.bench.victim_harness import profile_text, victim_server  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_schema_flood", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase (default 20)")
    p.add_argument("--loops", type=int, default=4, help="attacker request loops, each a process (default 4)")
    p.add_argument("--regex-groups", type=int, default=1000,
                   help="`(a|b)?` groups of each slow_schemas regex (default 1000: 6 kB, under the default "
                        "--max-schema-bytes, and over 15 s of CPU time to compile on 2 cores)")
    p.add_argument("--attacker-concurrency", type=int, default=None,
                   help="the attacker tenant's max_concurrent_requests (default: unlimited)")
    p.add_argument("--pin", action="store_true",
                   help="server on CPU 0, attacker and victim clients on the rest (default: no pinning)")
    p.add_argument("--work-dir", default="bench-out/schema-flood",
                   help="demo model, Redis data, server log (default bench-out/schema-flood)")
    p.add_argument("--json", default=None, help="write the report here (default: print only)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="sample the server with py-spy through each phase (raw stacks in DIR/<phase>.txt) and "
                        "report its CPU by category, with the kernel's per-thread CPU and wait for a core and "
                        "what other processes took of the server's CPUs (default: off)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra `loraplex serve` argument, repeatable (e.g. --serve-arg=--max-grammar-compile-ms=2000)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        print("bench_schema_flood: error: --pin needs 2 or more CPUs", file=sys.stderr)
        return 2
    if args.profile and can_profile() is not None:
        print(f"bench_schema_flood: error: --profile: {can_profile()}", file=sys.stderr)
        return 2
    with victim_server(Path(args.work_dir), args.model, args.serve_arg, args.pin) as (srv, target, attacker_cpus):
        admin = {"Authorization": f"Bearer {srv.admin_token}"}
        quota = {} if args.attacker_concurrency is None else {"max_concurrent_requests": args.attacker_concurrency}
        load_before = os.getloadavg()
        report = schema_flood.run(target, args.phase_s, args.loops, attacker_cpus, args.regex_groups, quota,
                                  log=lambda s: print(s, file=sys.stderr, flush=True),
                                  profile=(srv.proc.pid, Path(args.profile)) if args.profile else None)
        engine = httpx.get(srv.url + "/admin/engine", headers=admin).json()["structured_output"]
    report["server_structured_output"] = engine
    report["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                         "python": platform.python_version(), "model": target.model,
                         "serve_args": args.serve_arg, "pinned": args.pin,
                         "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    print(abuse.table(report))
    print(profile_text(report))
    print(f"compiles {engine['compiles']}, compile timeouts {engine['compile_timeouts']}, "
          f"failures {engine['failures']}; target (p99 ITL <= x{schema_flood.ITL_TARGET_RATIO}) met: {report['met']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
