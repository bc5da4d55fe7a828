#!/usr/bin/env python3
"""Fair under abuse (issue 22): a victim tenant's inter-token latency and /health latency while
another tenant runs each attack in turn, against a quiet baseline. Prints a table, writes JSON.

    .venv/bin/python scripts/bench_abuse.py --json docs/benchmarks/abuse-cpu.json
    .venv/bin/python scripts/bench_abuse.py --phase-s 5 --only huge_token_body,tokenize_flood

Starts `loraplex serve` on the demo model (or --model) with an embedded Redis under --work-dir.
With --pin (Linux, 2+ cores) the server runs on CPU 0 and the attacker's processes, the victim
client and the /health poller on the other CPUs. The report ends with the server's lease health
(leases lost, the longest a running request's lease went unrenewed). Target: each attack moves the
victim's p99 ITL by at most 20% and /health p99 stays <= 100 ms.
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

from server.bench import abuse  # noqa: E402
from server.bench.server_profile import can_profile  # noqa: E402
from server.bench.victim_harness import profile_text, victim_server  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_abuse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase (default 20)")
    p.add_argument("--only", default=None, help="comma-separated attacks to run (default: all)")
    p.add_argument("--pin", action="store_true",
                   help="server on CPU 0, attacker and victim clients on the rest (default: no pinning)")
    p.add_argument("--work-dir", default="bench-out/abuse", help="demo model, Redis data, server log "
                                                                 "(default bench-out/abuse)")
    p.add_argument("--json", default=None, help="write the report here (default: print only)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="sample the server with py-spy through each phase (raw stacks in DIR/<phase>.txt) and "
                        "report its CPU by category, with the kernel's per-thread CPU and wait for a core and "
                        "what other processes took of the server's CPUs (default: off)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra `loraplex serve` argument, repeatable (e.g. --serve-arg=--max-num-batched-tokens=256)")
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
    args = build_parser().parse_args(argv)
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        print("bench_abuse: error: --pin needs 2 or more CPUs", file=sys.stderr)
        return 2
    if args.profile and can_profile() is not None:
        print(f"bench_abuse: error: --profile: {can_profile()}", file=sys.stderr)
        return 2
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
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
