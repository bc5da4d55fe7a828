"""benchmarks/profile/token_divergence.py: first divergence, bit identity, margin and point verdicts."""
from __future__ import annotations

import pytest

from benchmarks.profile.token_divergence import (IDENTICAL, MISMATCH, NEAR_TIE_NATS, ROUNDING, Divergence,
                                                 Generated, Margin, divergences, first_divergence,
                                                 logprob_drift, not_bit_identical, point_verdict)

pytestmark = pytest.mark.unit


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([], []) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([7, 2], [1, 2]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # the shorter one ended there


def test_divergences_name_the_request_position_and_both_tokens():
    graphed = [[1, 2, 3], [4, 5, 6], [7, 8]]
    eager = [[1, 2, 3], [4, 9, 6], [7, 8, 0]]
    assert divergences(graphed, eager) == [Divergence(1, 1, 5, 9), Divergence(2, 2, None, 0)]
    with pytest.raises(ValueError):
        divergences(graphed, eager[:2])


def test_bit_identity_compares_tokens_and_logprobs_exactly():
    a = [Generated((1, 2), (-0.5, -1.25)), Generated((3,), (-2.0,))]
    assert not_bit_identical(a, list(a)) == []
    b = [Generated((1, 2), (-0.5, -1.25 + 2 ** -40)), Generated((4,), (-2.0,))]  # one ulp-level change
    assert not_bit_identical(a, b) == [0, 1]


def test_logprob_drift_is_taken_where_the_tokens_agree():
    a = [Generated((1, 2, 3), (-0.5, -1.0, -2.0)), Generated((4, 5), (-0.1, -0.2))]
    assert logprob_drift(a, a) == 0.0
    b = [Generated((1, 2, 9), (-0.5, -1.25, -7.0)), Generated((4, 5), (-0.1, -0.3))]  # position 2 differs: not taken
    assert logprob_drift(a, b) == pytest.approx(0.25)


def _margin(request: int, gap: float) -> Margin:
    return Margin(Divergence(request, 3, 10, 11), top_token=11, top_logprob=0.0, graphed_logprob=-gap)


def test_margin_verdict_is_rounding_within_the_bf16_tolerance():
    assert _margin(0, 0.0).gap == 0.0  # the teacher-forced top is the graphed token itself
    assert _margin(0, 0.01).verdict() == ROUNDING
    assert _margin(0, NEAR_TIE_NATS).verdict() == ROUNDING
    assert _margin(0, 0.5).verdict() == MISMATCH
    assert _margin(0, 0.5).verdict(tol=1.0) == ROUNDING


def test_point_verdict():
    v = point_verdict(8, [], [])
    assert (v.compared, v.identical, v.verdict, v.max_margin) == (8, 8, IDENTICAL, None)
    near = [_margin(1, 0.01), _margin(4, 0.03)]
    v = point_verdict(8, [m.divergence for m in near], near)
    assert (v.compared, v.identical, v.verdict) == (8, 6, ROUNDING) and v.max_margin == pytest.approx(0.03)
    far = near + [_margin(5, 0.2)]
    v = point_verdict(8, [m.divergence for m in far], far)
    assert (v.identical, v.verdict) == (5, MISMATCH) and v.max_margin == pytest.approx(0.2)
    # a divergence with no margin (the graphed generation ended early) is not excused as rounding
    v = point_verdict(8, [m.divergence for m in near] + [Divergence(6, 2, None, 3)], near)
    assert (v.identical, v.verdict) == (5, MISMATCH)
