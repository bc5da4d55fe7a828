"""A new adapter's slot load counts against the prefill cap while others decode (the
latency-aware cap's measured load cost, server.engine.step_latency.load_units): a storm of distinct
adapters' first requests is spread over steps, at least one per tenant and step, and every one of them
completes while another tenant decodes every step. The Scheduler with real parts (tests/server/engine/test_scheduler.py's
Steps driver), step times simulated."""
from __future__ import annotations

import pytest

from server.engine.scheduler import ScheduledBatch
from server.engine.step_latency import LatencyCap, StepLatency, StepTiming
from tests.server.engine.test_scheduler import Steps

pytestmark = pytest.mark.unit

DECODE_S, UNIT_S, LOAD_S = 0.010, 0.0001, 0.002  # a decode step, a prompt token, a copy into a slot (20 units)
STORM = 12


def _storm(load_s: float | None) -> tuple[Steps, list, list[ScheduledBatch]]:
    """A victim decoding on the base model, then STORM one-token requests for distinct adapters (4 slots),
    run to the end on a simulated clock; (the driver, the storm's sequences, the steps the storm ran in)."""
    versions = tuple(f"a{i}" for i in range(STORM))
    s = Steps(budget=128, cap=64, num_blocks=256, max_loras=4, versions=versions,
              latency_cap=LatencyCap(ratio=1.25, floor=4))
    victim = s.add(2, tenant="victim", max_tokens=200)
    s.step()
    latency = s.scheduler.latency
    latency.decode_seconds, latency.unit_seconds = DECODE_S, UNIT_S
    if load_s is not None:
        latency.load_seconds = load_s
    storm = [s.add(3, tenant="storm", version=v, max_tokens=1) for v in versions]
    steps = []
    while not all(seq.finished for seq in storm):
        assert len(steps) < 200, "the storm stopped making progress"
        loads = s.slots.loads
        batch = s.step()
        assert victim in batch.seqs  # the victim decodes in every step of the storm
        steps.append((batch, s.slots.loads - loads))
    return s, storm, steps


def test_a_storm_of_new_adapters_loads_one_per_step_when_a_load_takes_the_steps_room():
    # The cap: 1.25x a 10 ms step leaves 2.5 ms, 25 units; a load is 20 and a prompt 3: one new adapter a step.
    _, storm, steps = _storm(LOAD_S)
    assert all(seq.finished for seq in storm)
    assert max(loads for _, loads in steps) == 1
    assert sum(loads for _, loads in steps) == STORM


def test_loads_are_not_charged_before_one_is_measured():
    # No copy timed yet: only the prompts count, 25 units hold 8 of them, and the 4 slots bound the loads.
    _, storm, steps = _storm(None)
    assert all(seq.finished for seq in storm)
    assert max(loads for _, loads in steps) == 4


def test_a_load_costlier_than_the_whole_cap_still_lets_one_adapter_in_per_step():
    _, storm, steps = _storm(1.0)  # 10,000 units: over any cap, yet the storm's tenant gets its one per step
    assert all(seq.finished for seq in storm)
    assert [loads for _, loads in steps].count(1) == STORM


def test_the_engine_feeds_each_steps_loads_to_the_estimate():
    s, _, steps = _storm(None)
    batch = next(b for b, loads in steps if loads)
    assert batch.slot_loads >= 1
    s.scheduler.observe(DECODE_S + UNIT_S * batch.prompt_work + LOAD_S * batch.slot_loads, batch)
    latency = s.scheduler.latency
    assert latency.load_seconds == pytest.approx(LOAD_S) and latency.load_units() == pytest.approx(20.0)
    assert latency.unit_seconds == UNIT_S  # a step with loads does not teach the unit once one is known


def test_a_loads_units_are_what_it_added_to_a_step_beyond_its_prompt_work():
    latency = StepLatency(LatencyCap(ratio=1.25, floor=8))
    assert latency.load_units() == 0.0
    latency.observe(StepTiming(0.010, decoding=1, prompt_work=0))
    # Before a unit is known, a step with loads teaches the unit as any other: 20 units in 2 ms.
    latency.observe(StepTiming(0.012, decoding=1, prompt_work=20, slot_loads=2))
    assert latency.unit_seconds == pytest.approx(0.0001) and latency.load_seconds is None
    # Then 20 units (2 ms) and two loads took 6 ms beyond the decode step: 2 ms a load, 20 units.
    latency.observe(StepTiming(0.016, decoding=1, prompt_work=20, slot_loads=2))
    assert latency.unit_seconds == pytest.approx(0.0001) and latency.load_seconds == pytest.approx(0.002)
    assert latency.load_units() == pytest.approx(20.0)
