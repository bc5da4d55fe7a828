"""Mask-lane fairness across tenants (issue 43, build item 1): one tenant's many constrained requests
cannot take the whole grammar-mask lane while another tenant's constrained request waits. The lane
takes fills in turns across tenants (server.engine.fair_lane): with one tenant's fills queued twenty
deep behind busy threads, another tenant's one fill is taken after at most one more of theirs, not
after all twenty (a FIFO's order). Order, not time, is what is asserted."""
from __future__ import annotations

import threading
import time

import pytest

from server.engine import LLM, StructuredOutputsParams
from server.engine.fair_lane import FairLane
from tests.server.engine.test_engine_structured import REGEX


def _wait(futures, seconds: float = 30.0) -> None:
    for f in futures:
        f.result(timeout=seconds)


@pytest.mark.unit
def test_a_tenants_one_job_waits_for_one_turn_not_for_another_tenants_queue():
    lane = FairLane(1, "test-lane")
    started, gate = threading.Event(), threading.Event()
    jobs = [lane.submit("a", lambda: (started.set(), gate.wait()))]
    assert started.wait(30)  # the thread is busy with tenant a's first job
    jobs += [lane.submit("a", lambda: None) for _ in range(20)]
    jobs += [lane.submit("b", lambda: None)]
    jobs += [lane.submit("c", lambda: None), lane.submit("c", lambda: None)]
    gate.set()
    _wait(jobs)
    # a (running), then a, b, c, a, c, a, a, ...: every tenant with work waiting gets a turn in between.
    assert lane.dispatched[:6] == ["a", "a", "b", "c", "a", "c"], lane.dispatched
    assert lane.dispatched.count("a") == 21
    lane.shutdown()


@pytest.mark.unit
def test_a_tenant_alone_has_every_thread_and_a_failing_job_fails_its_future_only():
    lane = FairLane(2, "test-lane")
    running, gate = threading.Semaphore(0), threading.Event()

    def hold() -> None:
        running.release()
        gate.wait()
    held = [lane.submit("a", hold), lane.submit("a", hold)]
    assert running.acquire(timeout=30) and running.acquire(timeout=30)  # both threads run tenant a's jobs
    gate.set()
    _wait(held)
    boom = lane.submit("a", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        boom.result(timeout=30)
    _wait([lane.submit("a", lambda: None)])
    lane.shutdown()


def test_the_engines_mask_lane_takes_fills_in_turns_across_tenants(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", max_model_len=256, kv_cache_blocks=64)
    grammars = llm.engine.grammars
    compiled = grammars.compile(StructuredOutputsParams(regex=REGEX))
    lane = grammars.lane.pool
    gate = threading.Event()
    threads = lane._threads
    blocked = [lane.submit("attacker", gate.wait) for _ in range(threads)]  # every fill thread busy
    attacker = [grammars.choice_matcher(compiled, "regex", None, "attacker") for _ in range(20)]
    victim = grammars.choice_matcher(compiled, "regex", None, "victim")
    gate.set()
    _wait(blocked)
    deadline = time.monotonic() + 60
    while not (victim.ready and all(m.ready for m in attacker)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    order = lane.dispatched[-(threads + 21):]
    # The victim's fill went after at most one more attacker fill per thread, not after all twenty.
    assert order.index("victim") <= 2 * threads, order
    assert victim.failure is None and victim.ready
