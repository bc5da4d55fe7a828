#!/usr/bin/env python3
"""Fair under abuse (issue 22): a victim tenant's inter-token latency and /health latency while
another tenant runs each attack in turn, against a quiet baseline. Prints a table, writes JSON.

    .venv/bin/python -m benchmarks.security.bench_abuse --json docs/benchmarks/abuse-cpu.json
    .venv/bin/python -m benchmarks.security.bench_abuse --phase-s 5 --only huge_token_body,tokenize_flood

Starts `loraplex serve` on the demo model (or --model) with an embedded Redis under --work-dir, local
and loopback http adapter sources (slow_source's attackers serve theirs from slow and dripping
sources on loopback; the victim's cold loads come from COLD_ADAPTERS new adapters built once under
--work-dir/local-adapters), and --fetch-timeout and --compile-deadline-ms as the server's fetch and
compile deadlines. With --pin (Linux, 2+ cores) the server runs on CPU 0 and the attacker's
processes, the victim client and the /health poller on the other CPUs. The report ends with the server's lease health
(leases lost, the longest a running request's lease went unrenewed). Target: each attack moves the
victim's p99 ITL by at most 20% (30% under issue 43's: nested_grammar, nested_regex, slow_source,
compile_flood) and /health p99 stays <= 100 ms; the victim's cold local loads take <= 1 s and the
attacker's requests end within the server's bound on them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
from pathlib import Path

import httpx

from benchmarks.profile.cpu_model import cpu_model
from benchmarks.security import abuse
from benchmarks.security.victim_harness import (add_victim_server_args, check_victim_server_args,
                                                profile_text, victim_server)
from server.bench.artifacts import write_json

COLD_ADAPTERS = 3  # the baseline's cold load and slow_source's two


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_abuse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_victim_server_args(p, "bench-out/abuse", "--max-num-batched-tokens=256")
    p.add_argument("--only", default=None, help="comma-separated attacks to run (default: all)")
    p.add_argument("--fetch-timeout", type=float, default=4.0,
                   help="the server's --adapter-fetch-timeout: slow_source's attacker budget (default 4 s)")
    p.add_argument("--compile-deadline-ms", type=int, default=1000,
                   help="the server's --max-grammar-compile-ms: the compile attacks' budget (default 1000)")
    return p


def _cold_adapters(model: Path, root: Path) -> list[str]:
    """COLD_ADAPTERS distinct adapters of `model` under `root` (built once), as local references."""
    from server.demo import make_adapter

    names = [f"cold{i}" for i in range(COLD_ADAPTERS)]
    for i, name in enumerate(names):
        if not (root / name / "adapter_model.safetensors").exists():
            make_adapter(model, root / name, r=8, lora_alpha=16, seed=4300 + i)
    return names


def _source_serve_args(root: Path, fetch_timeout: float, compile_deadline_ms: int) -> list[str]:
    """Local references under `root`, http ones on loopback, and the two deadlines."""
    return ["--adapter-sources", "http,local", "--adapter-local-root", str(root), "--adapter-http-hosts", "127.0.0.1",
            "--adapter-allow-private-networks", "--adapter-fetch-timeout", str(fetch_timeout),
            "--max-grammar-compile-ms", str(compile_deadline_ms)]


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
    work = Path(args.work_dir)
    if args.model is None:
        from server.demo import ensure_demo
        model = ensure_demo(work / "demo").model_dir
    else:
        model = Path(args.model)
    root = work / "local-adapters"
    cold = _cold_adapters(model, root)
    serve_args = [*_source_serve_args(root, args.fetch_timeout, args.compile_deadline_ms), *args.serve_arg]
    trace = Path(args.trace) if args.trace else None
    with victim_server(work, str(model), serve_args, args.pin, args.pin_engine, trace) as (srv, target, attacker_cpus):
        target = dataclasses.replace(target, fetch_timeout_s=args.fetch_timeout,
                                     compile_deadline_s=args.compile_deadline_ms / 1000)
        admin = {"Authorization": f"Bearer {srv.admin_token}"}
        load_before = os.getloadavg()
        report = abuse.run(target, args.phase_s, args.only.split(",") if args.only else None,
                           log=lambda s: print(s, file=sys.stderr, flush=True), attacker_cpus=attacker_cpus,
                           profile=(srv.proc.pid, Path(args.profile)) if args.profile else None, cold_adapters=cold,
                           attacker_nice=args.attacker_nice, trace=trace)
        report["leases"] = _lease_health(httpx.get(srv.url + "/metrics", headers=admin).text)
    report["machine"] = {"cpu": cpu_model(), "cores": os.cpu_count(),
                         "python": platform.python_version(), "model": target.model,
                         "max_model_len": target.max_model_len, "max_logprob_entries": target.max_logprob_entries,
                         "serve_args": serve_args, "pinned": args.pin, "pinned_engine": args.pin_engine,
                         "attacker_nice": args.attacker_nice,
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
