"""The grammar compile deadline counts the compile process's CPU time, not the wall-clock time
the request waits: a cheap constraint compiled while its core is saturated by CPU-burning
processes (pinned to it, at a higher priority than the compiler) is accepted, though its compile
takes longer than the budget on the wall clock. A pathological one is killed past its CPU budget,
a process that makes no progress past the wall-clock cap, and a killed process's replacement
starts in the background: the next compile takes the warm spare, not a process start.
Real compile processes, real xgrammar, real burners."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from server.engine.grammar import Grammars
from server.engine.grammar_worker import GrammarCompileService, GrammarTimeout
from server.engine.structured_outputs import StructuredOutputsParams

# Compile CPU on the 2-core dev machine, vocabulary 512: "(a|b)?" x 150 0.12 s, x 1000 over 15 s.
CHEAP = StructuredOutputsParams(regex="(a|b)?" * 150)
PATHOLOGICAL = StructuredOutputsParams(regex="(a|b)?" * 1000)
BURNERS = 2


@pytest.fixture(scope="module")
def grammars(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return Grammars(tok, 512, [tok.eos_token_id])


def _wait_warm(service: GrammarCompileService) -> None:
    deadline = time.monotonic() + 300
    while not service.all_started:
        assert time.monotonic() < deadline, "the compile processes never all started"
        time.sleep(0.05)


# 12x the cheap compile's quiet CPU time: on a loaded 2-vCPU machine (an SMT sibling busy with another
# test worker) its CPU time grew past 500 ms, 4x its quiet value. Starved as below it still takes seconds.
BUDGET_MS = 1500


@pytest.fixture(scope="module")
def core() -> int:
    return max(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def service(grammars, core):
    """A warm pool, its processes pinned to `core` (they inherit the affinity of the thread that
    starts them); the wall-clock cap out of the way, so only the CPU budget can refuse."""
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        service = GrammarCompileService(grammars, timeout_ms=BUDGET_MS, wall_cap_ms=600_000)
        service.compile(StructuredOutputsParams(choice=["warm"]))
        _wait_warm(service)
    finally:
        os.sched_setaffinity(0, old)
    # The processes fork from multiprocessing's fork server, which keeps the affinity of whoever started
    # it first (another test's server in this worker, maybe): pin the warm ones themselves.
    for process in service._ready:
        os.sched_setaffinity(process.proc.pid, {core})
    yield service
    service.shutdown()


def test_a_cheap_constraint_starved_of_cpu_is_still_accepted(service, grammars, core):
    # Burners at the default priority, on the compile processes' core: each gets ~10x the share
    # of a compile process at niceness 10.
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                preexec_fn=lambda: os.sched_setaffinity(0, {core})) for _ in range(BURNERS)]
    try:
        start = time.monotonic()
        compiled = service.compile(CHEAP)
        wall_s = time.monotonic() - start
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert compiled is not None and grammars.lookup(CHEAP) is compiled
    # It was starved: a deadline on the wall clock would have refused it.
    assert wall_s > BUDGET_MS / 1000, f"the compile took {wall_s:.2f} s: its core was not saturated"
    assert service.timeouts == 0


def test_a_killed_compile_is_replaced_in_the_background_by_a_warm_spare(service):
    _wait_warm(service)
    timeouts = service.timeouts
    with pytest.raises(GrammarTimeout, match=f"within {BUDGET_MS} ms of CPU time") as e:
        service.compile(PATHOLOGICAL)
    assert e.value.wall_cap_ms is None and service.timeouts == timeouts + 1
    cold = service.cold_starts
    assert service.compile(StructuredOutputsParams(choice=["next"])) is not None
    assert service.cold_starts == cold, "the compile after the kill waited for a process start"
    _wait_warm(service)  # the replacement joined the pool


def test_a_compile_past_the_wall_clock_cap_is_killed(grammars):
    service = GrammarCompileService(grammars, timeout_ms=600_000, wall_cap_ms=1000, processes=1, spares=0)
    try:
        with pytest.raises(GrammarTimeout, match="within the 1000 ms wall-clock cap") as e:
            service.compile(PATHOLOGICAL)
        assert e.value.wall_cap_ms == 1000 and service.timeouts == 1
    finally:
        service.shutdown()
