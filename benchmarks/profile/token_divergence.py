"""Graphed against eager greedy generations: bit identity, where a request's tokens first differ, whether
that difference is a near-tie (rounding) or a real one, and a point's verdict.

Pure functions over token ids and logprobs, so that benchmarks/profile/gpu_profile_step.py's decisions
are tested on a CPU; the script feeds them what the engines generated.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A flip of the greedy token is rounding when the eager engine, teacher-forced to the common prefix, puts
# the graphed engine's token within this many nats of its own top token. bf16 keeps 8 significant bits
# (unit roundoff 2^-8 = 0.004 relative), so two engines that reduce the same 4096-wide (14336 for down)
# products in different orders or kernels differ by a few such roundings at every layer, and the logits
# themselves are rounded to bf16. The random Llama-3-8B-shaped model (server/bench/gpu_model.py: every
# weight scaled by 1/sqrt(fan-in)) has unit-variance logits, its top ones over 128256 tokens near 4.5,
# where one bf16 ulp is 2^-5 = 0.031. A logprob gap is a logit gap (one shared normalizer), so 0.05 is
# about 1.5 ulps there: two tokens closer than that may swap under either engine (and on this model the
# top two are that close at roughly one position in five); a real bug (a wrong adapter, stale inputs)
# moves the logits by far more, at many positions.
NEAR_TIE_NATS = 0.05

IDENTICAL, ROUNDING, MISMATCH = "identical", "rounding", "MISMATCH"


@dataclass(frozen=True)
class Generated:
    """One request's greedy generation: its token ids and each token's logprob (empty when not asked)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Divergence:
    request: int  # index into the point's requests
    position: int  # first generated token that differs
    graphed_token: int | None  # None: that generation ended before this position
    eager_token: int | None


@dataclass(frozen=True)
class Margin:
    """The eager engine teacher-forced to a divergence's common prefix: its top token there and the
    logprobs of that token and of the graphed engine's token."""

    divergence: Divergence
    top_token: int
    top_logprob: float
    graphed_logprob: float

    @property
    def gap(self) -> float:
        return self.top_logprob - self.graphed_logprob

    def verdict(self, tol: float = NEAR_TIE_NATS) -> str:
        return ROUNDING if self.gap <= tol else MISMATCH


@dataclass(frozen=True)
class PointVerdict:
    compared: int
    identical: int
    max_margin: float | None  # the largest first-divergence gap; None when every request is identical
    verdict: str  # IDENTICAL, ROUNDING or MISMATCH


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a shorter list differs where it ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergences(graphed: Sequence[Sequence[int]], eager: Sequence[Sequence[int]]) -> list[Divergence]:
    """Every request whose tokens differ, at its first differing position."""
    if len(graphed) != len(eager):
        raise ValueError(f"{len(graphed)} graphed requests against {len(eager)} eager ones")
    found = []
    for i, (g, e) in enumerate(zip(graphed, eager)):
        at = first_divergence(g, e)
        if at is not None:
            found.append(Divergence(i, at, g[at] if at < len(g) else None, e[at] if at < len(e) else None))
    return found


def not_bit_identical(a: Sequence[Generated], b: Sequence[Generated]) -> list[int]:
    """Requests whose tokens or logprobs are not exactly equal (floats compared bit for bit)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} requests against {len(b)}")
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


def logprob_drift(a: Sequence[Generated], b: Sequence[Generated]) -> float:
    """The largest |logprob difference| of one token under both runs, over each request's positions before
    its tokens first differ: how far apart the runs' numbers are where they agree on the tokens."""
    drift = 0.0
    for x, y in zip(a, b):
        at = first_divergence(x.tokens, y.tokens)
        agreed = min(len(x.logprobs), len(y.logprobs)) if at is None else at
        drift = max([drift] + [abs(p - q) for p, q in zip(x.logprobs[:agreed], y.logprobs[:agreed])])
    return drift


def point_verdict(compared: int, found: Sequence[Divergence], margins: Sequence[Margin],
                  tol: float = NEAR_TIE_NATS) -> PointVerdict:
    """A point's verdict over `compared` requests: identical, rounding when every divergence has a margin
    within tol, MISMATCH otherwise (a divergence without a margin, e.g. one generation shorter, included)."""
    if not found:
        return PointVerdict(compared, compared, None, IDENTICAL)
    measured = {m.divergence.request for m in margins}
    worst = max((m.gap for m in margins), default=None)
    ok = all(d.request in measured for d in found) and all(m.verdict(tol) == ROUNDING for m in margins)
    return PointVerdict(compared, compared - len(found), worst, ROUNDING if ok else MISMATCH)
