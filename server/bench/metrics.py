"""Per-request timings and the summary every target reports in the same shape.

Times are seconds from the start of the run. TTFT counts from the request's
scheduled arrival (S-LoRA's definition), so a request that queued in the
client or in a baseline's backlog pays for its wait. ITL is the gap between
successive token arrivals as the client saw them (a streamed chunk may carry
several tokens; its gap is counted once).
"""
from __future__ import annotations

import hashlib

import math
from dataclasses import dataclass, field

from server.bench.step_kinds import StepSample

@dataclass
class RequestRecord:
    index: int
    tenant: str
    adapter: str | None
    arrival_s: float
    prompt_tokens: int
    expected_tokens: int
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # arrival time of each chunk of output
    token_counts: list[int] = field(default_factory=list)  # tokens in each chunk, where known (else 1 each)
    end_s: float | None = None
    output_tokens: int = 0
    error: str | None = None
    text: str = ""  # the streamed completion (HTTP targets), to compare two servers' outputs

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and self.first_token_s is not None

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    def gaps_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class ClosedLoopRun:
    """A fixed-concurrency run: every request sent, and when the concurrency stopped being held
    (the deadline, or the trace running out with a slot to refill, whichever came first)."""
    records: list[RequestRecord]
    held_until_s: float
    trace_exhausted: bool
    # The engine target's steps (server.bench.step_kinds); none from an HTTP client, which cannot see them.
    steps: list[StepSample] = field(default_factory=list)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either side is missing (or b is 0): a point some system did not run."""
    return a / b if a is not None and b else None


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _latency_block(records: list[RequestRecord], ttft_slo_s: float) -> dict:
    ttft = [r.ttft_s for r in records]
    gaps = [g for r in records for g in r.gaps_s()]
    return {
        "ttft_s": {"mean": sum(ttft) / len(ttft) if ttft else None, "p50": percentile(ttft, 50),
                   "p90": percentile(ttft, 90), "p99": percentile(ttft, 99)},
        "itl_s": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99)},
        "slo_attainment": (sum(t <= ttft_slo_s for t in ttft) / len(ttft)) if ttft else None,
    }


def summarize(records: list[RequestRecord], ttft_slo_s: float) -> dict:
    """Throughput over the run's span (t = 0 to the last completion), latency percentiles,
    TTFT SLO attainment; overall and per tenant. Failed requests count against the SLO."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    span = max((r.end_s for r in done), default=0.0)
    out_tokens = sum(r.output_tokens for r in done)
    summary = {
        "requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "errors": sorted({r.error or "no output" for r in failed})[:5],
        "duration_s": span,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "short_outputs": sum(r.output_tokens < r.expected_tokens for r in done),
        "throughput_req_s": len(done) / span if span > 0 else 0.0,
        "throughput_tok_s": out_tokens / span if span > 0 else 0.0,
        **_latency_block(done, ttft_slo_s),
        "ttft_slo_s": ttft_slo_s,
    }
    if records:
        summary["slo_attainment"] = (summary["slo_attainment"] or 0.0) * len(done) / len(records)
    per_tenant = {}
    for tenant in sorted({r.tenant for r in records}):
        mine = [r for r in records if r.tenant == tenant]
        ok = [r for r in mine if r.ok]
        block = _latency_block(ok, ttft_slo_s)
        block["slo_attainment"] = (block["slo_attainment"] or 0.0) * len(ok) / len(mine)
        per_tenant[tenant] = {"requests": len(mine), "completed": len(ok),
                              "output_tokens": sum(r.output_tokens for r in ok),
                              "throughput_tok_s": sum(r.output_tokens for r in ok) / span if span > 0 else 0.0,
                              **block}
    summary["per_tenant"] = per_tenant
    return summary


def window_summary(records: list[RequestRecord], start_s: float, end_s: float) -> dict:
    """A steady-state window [start_s, end_s): only what happened inside it counts.

    Output tokens are those whose chunk arrived in the window (decode tok/s = tokens / window);
    TTFT is over requests sent in the window whose first token came (in it or after); ITL over the
    gaps that end in the window. Requests still running at either edge count for the tokens they
    produced inside, so neither the ramp-up nor the drain is in the numbers.
    """
    span = end_s - start_s
    if span <= 0:
        return {"window_s": max(span, 0.0), "output_tokens": 0, "throughput_tok_s": None, "requests_sent": 0,
                "requests_finished": 0, "ttft_s": {"p50": None, "p90": None, "p99": None},
                "itl_s": {"p50": None, "p90": None, "p99": None}}

    def inside(t: float) -> bool:
        return start_s <= t < end_s

    tokens = sum(n for r in records
                 for t, n in zip(r.token_times_s, r.token_counts or [1] * len(r.token_times_s)) if inside(t))
    sent = [r for r in records if inside(r.arrival_s)]
    ttft = [r.ttft_s for r in sent if r.first_token_s is not None]
    gaps = [b - a for r in records for a, b in zip(r.token_times_s, r.token_times_s[1:]) if inside(b)]
    return {
        "window_s": span, "output_tokens": tokens, "throughput_tok_s": tokens / span, "requests_sent": len(sent),
        "requests_finished": sum(r.end_s is not None and inside(r.end_s) for r in records),
        "ttft_s": {q: percentile(ttft, int(q[1:])) for q in ("p50", "p90", "p99")},
        "itl_s": {q: percentile(gaps, int(q[1:])) for q in ("p50", "p90", "p99")},
    }


def output_digests(records: list[RequestRecord]) -> list[str | None]:
    """Per request, a digest of its completion text (None where it failed): two servers given the
    same seeded greedy workload should agree, and a fast server with other outputs is no win."""
    return [hashlib.sha256(r.text.encode("utf-8")).hexdigest()[:16] if r.ok else None for r in records]


def agreement(a: list[str | None] | None, b: list[str | None] | None) -> dict | None:
    """How many requests both sides completed with the same text; None without both lists."""
    if a is None or b is None:
        return None
    assert len(a) == len(b), (len(a), len(b))
    both = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return {"compared": len(both), "same": sum(x == y for x, y in both)}
