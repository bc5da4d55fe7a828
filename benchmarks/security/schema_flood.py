"""The hostile-schema flood (issue 24): one tenant sends distinct structured-output constraints
as fast as it can while a victim tenant streams unconstrained greedy completions; the victim's
p99 inter-token latency in each flood phase against a quiet baseline (target: moves <= 10%).

Phases, each `phase_s` seconds: baseline (no attacker), then
- slow_schemas: every request a distinct catastrophic regex (`(a|b)?` repeated) that takes more
  CPU time to compile than the deadline allows, so each one holds a compile process until it is
  killed (and replaced) and ends in a 400;
- many_schemas: every request a distinct small schema from the suite (a salted `const` makes
  each one new to the grammar cache), compiled and then generated for a few tokens.

The victim and /health poller are the abuse bench's (benchmarks.security.victim_harness). The attacker's loops
run in their own processes, optionally pinned to CPUs of their own (`attacker_cpus`).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import httpx

from benchmarks.security.victim_harness import LoopResult, Target, new_tenant, run_phases

ITL_TARGET_RATIO = 1.10
PHASES = ("slow_schemas", "many_schemas")


def slow_regex(tag: str, groups: int = 1000) -> str:
    # 1000 groups: 6 kB, far under --max-schema-bytes, and over 15 s of CPU time to compile on the
    # 2-core machine (an enum slow to compile is larger than the default byte cap: 6000 values
    # took 9 s, while 2200 values, 45 kB, compile within a second of CPU time)
    return tag + "(a|b)?" * groups


def _small_schema(suite: list[dict], i: int, tag: str) -> dict:
    schema = suite[i % len(suite)]
    return {"type": "object", "properties": {"salt": {"const": f"{tag}-{i}"}, "value": schema},
            "required": ["salt", "value"], "additionalProperties": False,
            **({"$defs": schema["$defs"]} if "$defs" in schema else {})}


def _flood_loop(url: str, key: str, model: str, phase: str, loop: int, phase_s: float,
                regex_groups: int) -> LoopResult:
    """One attacker loop: distinct constraints, one request after another, for phase_s seconds."""
    from server.bench.schema_suite import load_suite

    suite = [s for _, s in load_suite()]
    result = LoopResult()
    statuses = result.statuses
    deadline = time.monotonic() + phase_s
    tag = f"{(os.getpid() * 31 + loop) % 10**4:04d}"
    i = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as c:
        while time.monotonic() < deadline:
            i += 1
            if phase == "slow_schemas":
                body = {"model": model, "prompt": "x", "max_tokens": 4,
                        "guided_regex": slow_regex(f"{tag}{i:04d}", regex_groups)}
            else:
                body = {"model": model, "prompt": "x", "max_tokens": 8, "temperature": 1.0,
                        "response_format": {"type": "json_schema", "json_schema": {
                            "name": "flood", "schema": _small_schema(suite, i, tag)}}}
            start = time.monotonic()
            try:
                r = c.post("/v1/completions", json=body)
                # a refusal's reason with its status: the flood must reach the compiler, not a size cap
                statuses[str(r.status_code) + ("" if r.status_code == 200 else f" {r.text[12:70]}")] += 1
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1
            result.longest_s = max(result.longest_s, time.monotonic() - start)
    return result


def run(target: Target, phase_s: float = 20.0, loops: int = 4, attacker_cpus: tuple[int, ...] | None = None,
        regex_groups: int = 1000, attacker_quota: dict | None = None,
        log: Callable[[str], None] = lambda s: None, profile: tuple[int, Path] | None = None,
        attacker_nice: int = 0, trace: Path | None = None) -> dict:
    """The baseline and both flood phases; returns the JSON report (`trace`: run_phases')."""
    tag = str(int(time.time() * 1000))[-8:]
    victim = new_tenant(target, f"victim-{tag}", {})
    attacker = new_tenant(target, f"flooder-{tag}", attacker_quota or {})

    def start(name: str, pool: ProcessPoolExecutor) -> list[Future]:
        return [pool.submit(_flood_loop, target.url, attacker, target.model, name, i, phase_s, regex_groups)
                for i in range(loops)]

    phases = run_phases(target, victim, list(PHASES), phase_s, loops, start, attacker_cpus, log, profile,
                        attacker_nice=attacker_nice, trace=trace)
    baseline = phases[0]
    summaries = {}
    for p in phases:
        s = p.summary(None if p is baseline else baseline)
        if p is not baseline:
            s["met"] = s["itl_p99_vs_baseline"] is not None and s["itl_p99_vs_baseline"] <= ITL_TARGET_RATIO
        summaries[p.name] = s
    return {"phase_s": phase_s, "attacker_loops": loops, "attacker_cpus": attacker_cpus, "regex_groups": regex_groups,
            "attacker_quota": attacker_quota or {}, "targets": {"itl_p99_ratio": ITL_TARGET_RATIO},
            "phases": summaries, "met": all(s.get("met", True) for s in summaries.values())}
