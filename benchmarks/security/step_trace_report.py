#!/usr/bin/env python3
"""A victim bench's `--trace DIR` lined up: each phase's victim gaps against the engine steps that ran
during them (server.engine.step_trace), so a slow gap reads as "an engine step this long, carrying these
prompt chunks" or as "the engine was idle: the time went outside it (front end, client, IPC)".

    .venv/bin/python -m benchmarks.security.step_trace_report DIR logprob_echo_in_budget [--top 12]

Prints the phase's steps by kind (whether the victim decoded or prefilled in it, whether another tenant's
prompt chunk rode along, whether the prompt work was capped), the victim's time to first token, and its
longest gaps, each with the steps it overlapped (offset into the gap, duration as schedule/run/post-process,
V: the victim decoded in it, P: its prompt ran in it; the other tenants' chunks as (first position, tokens,
prompt-logprob rows); the step's prompt budget) and how much of it no step covered.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

from server.bench.metrics import percentile


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _p99(values: list[float]) -> float:
    return percentile(values, 99)  # the benches' own percentile, so the report's p99 is their table's


def load_steps(trace: Path, start: float, end: float) -> list[dict]:
    """The steps that started between `start` and `end`, each with who it served: the victim is the tenant
    (an id in the engine) with the most decoding rows, as the victim streams throughout."""
    steps = [s for s in map(json.loads, (trace / "steps.jsonl").read_text().splitlines()) if start <= s["start"] <= end]
    decoding = Counter(r["tenant"] for s in steps for r in s["rows"] if not r["prompt"])
    victim = decoding.most_common(1)[0][0] if decoding else None
    for s in steps:
        s["seconds"] = s["schedule_s"] + s["run_s"] + s["postprocess_s"]
        s["end"] = s["start"] + s["seconds"]
        mine = [r["tenant"] == victim for r in s["rows"]]
        s["victim_decoded"] = any(m and not r["prompt"] for m, r in zip(mine, s["rows"]))
        s["victim_prompt"] = any(m and r["prompt"] for m, r in zip(mine, s["rows"]))
        s["others"] = [(r["start"], r["tokens"], r["logprob_rows"]) for m, r in zip(mine, s["rows"])
                       if not m and r["prompt"]]
    return steps


def kind(step: dict) -> str:
    who = "victim decodes" if step["victim_decoded"] else "victim prefills" if step["victim_prompt"] else "no victim"
    return (who + (" + other's chunk" if step["others"] else "")
            + (", capped" if step["prompt_budget"] is not None else ""))


def report(trace: Path, phase: str, top: int) -> str:
    victim = json.loads((trace / f"{phase}-victim.json").read_text())
    steps = load_steps(trace, victim["start"], victim["end"])
    lines = [f"{phase}: {len(steps)} steps, {len(victim['gaps'])} victim gaps, {len(victim['requests'])} victim requests"]
    by_kind: dict[str, list[float]] = {}
    for s in steps:
        by_kind.setdefault(kind(s), []).append(s["seconds"])
    for k, secs in sorted(by_kind.items()):
        lines.append(f"  {k:<44} {len(secs):6d} steps, {sum(secs):7.3f} s, p50 {_ms(statistics.median(secs))} ms, "
                     f"p99 {_ms(_p99(secs))} ms, max {_ms(max(secs))} ms")
    ttft = [first - sent for sent, first in victim["requests"]]
    if ttft:
        lines.append(f"  victim time to first token: p50 {_ms(statistics.median(ttft))} ms, max {_ms(max(ttft))} ms")
    gaps = [g for _, g in victim["gaps"]]
    if not gaps:
        return "\n".join(lines)
    lines.append(f"  victim gaps: p50 {_ms(statistics.median(gaps))} ms, p99 {_ms(_p99(gaps))} ms; the longest:")
    for end, gap in sorted(victim["gaps"], key=lambda eg: -eg[1])[:top]:
        begin = end - gap
        during = [s for s in steps if s["end"] > begin and s["start"] < end]
        covered = sum(min(s["end"], end) - max(s["start"], begin) for s in during)
        parts = [f"{_ms(s['start'] - begin)} +{_ms(s['seconds'])} ({_ms(s['schedule_s'])}/{_ms(s['run_s'])}/"
                 f"{_ms(s['postprocess_s'])}) {'V' if s['victim_decoded'] else ''}{'P' if s['victim_prompt'] else ''}"
                 f" {s['others'] or ''} budget {s['prompt_budget'] if s['prompt_budget'] is None else round(s['prompt_budget'], 1)}"
                 for s in during]
        lines.append(f"  {_ms(gap)} ms gap, {_ms(gap - covered)} ms outside steps: " + "; ".join(parts))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="the bench's --trace DIR")
    ap.add_argument("phase", help="a phase name (DIR/<phase>-victim.json)")
    ap.add_argument("--top", type=int, default=12, help="longest gaps to show (default 12)")
    args = ap.parse_args()
    print(report(args.trace, args.phase, args.top))


if __name__ == "__main__":
    main()
