"""The latency-aware prefill cap's estimates (server.engine.step_latency), from injected step times."""
from __future__ import annotations

import pytest

from server.engine.config import EngineConfig
from server.engine.step_latency import WINDOW, LatencyCap, StepLatency, StepTiming

pytestmark = pytest.mark.unit


def test_before_both_estimates_exist_the_static_cap_holds():
    latency = StepLatency(LatencyCap())
    assert latency.cap(256) == 256
    latency.observe(StepTiming(0.030, decoding=1, prompt_work=100))  # no decode-only step seen: not learnt
    assert latency.unit_seconds is None and latency.cap(256) == 256
    latency.observe(StepTiming(0.010, decoding=2, prompt_work=0))
    assert latency.cap(256) == 256


def test_the_cap_is_the_prompt_work_that_costs_the_ratios_excess_of_a_decode_step():
    latency = StepLatency(LatencyCap(ratio=1.25, floor=8))
    latency.observe(StepTiming(0.010, decoding=1, prompt_work=0))
    latency.observe(StepTiming(0.012, decoding=1, prompt_work=20))  # 0.1 ms a unit
    assert latency.cap(256) == pytest.approx(25.0)
    assert latency.cap(16) == 16  # never above the static cap
    latency.observe(StepTiming(0.0105, decoding=0, prompt_work=0))  # an idle step: nothing
    assert latency.decode_seconds == 0.010


def test_the_floor_keeps_a_costly_prompt_moving():
    latency = StepLatency(LatencyCap(ratio=1.25, floor=8))
    latency.observe(StepTiming(0.010, decoding=1, prompt_work=0))
    latency.observe(StepTiming(0.110, decoding=1, prompt_work=10))  # 10 ms a unit: room for a quarter of one
    assert latency.cap(256) == 8


def test_a_step_faster_than_a_decode_step_teaches_no_negative_cost():
    latency = StepLatency(LatencyCap())
    latency.observe(StepTiming(0.010, decoding=1, prompt_work=0))
    latency.observe(StepTiming(0.008, decoding=0, prompt_work=4))
    assert latency.unit_seconds == 0.0 and latency.cap(256) == 256  # no cost known yet: the static cap


def test_steps_preempted_by_other_processes_do_not_move_the_estimates():
    latency = StepLatency(LatencyCap(ratio=1.25, floor=8))
    for i in range(WINDOW):
        slow = i % 3 == 0  # a third of the steps waited 100 ms for the core
        latency.observe(StepTiming(0.010 + 0.100 * slow, decoding=1, prompt_work=0))
    assert latency.decode_seconds == 0.010
    latency.observe(StepTiming(1.010, decoding=1, prompt_work=100))  # a first prompt step's one-time costs
    for i in range(WINDOW - 1):
        latency.observe(StepTiming(0.012 + 0.100 * (i % 3 == 0), decoding=1, prompt_work=20))
    assert latency.unit_seconds == pytest.approx(0.0001) and latency.cap(256) == pytest.approx(25.0)


def test_the_estimates_follow_a_lasting_change_within_their_window():
    latency = StepLatency(LatencyCap())
    for seconds in (0.010,) * WINDOW + (0.020,) * (WINDOW // 2 + 1):
        latency.observe(StepTiming(seconds, decoding=1, prompt_work=0))
    assert latency.decode_seconds == 0.020


def test_a_ratio_at_or_below_one_is_refused():
    with pytest.raises(AssertionError):
        LatencyCap(ratio=1.0)


def test_the_engine_refuses_a_ratio_without_a_cap_to_bound():
    with pytest.raises(ValueError, match="max_prefill_step_ratio"):
        EngineConfig.of("m", max_prefill_step_ratio=1.25)
    assert EngineConfig.of("m", max_prefill_tokens_while_decoding=256, max_prefill_step_ratio=1.25)
