"""A hung engine core is killed and restarted, but a front end that was itself held up does not mistake
that for the core's silence (server.engine.protocol.core_silence). The CI's first failure of this kind:
"the engine core sent nothing for 3 s" on a loaded 2-core machine, where a core was serving fine.

The front end is held up for real: a call through ctypes.PyDLL keeps this process's GIL for its whole
length (a PyDLL call does not release it), so the receiver thread cannot run, as when another thread's
C call holds the GIL; the core is paused for real with SIGSTOP."""
from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest

from server.engine.core.messages import STATS_INTERVAL_S
from server.engine.protocol.core_silence import CoreSilence
from server.engine.protocol.remote import RemoteEngineClient, RestartPolicy
from tests.remote_core import greedy_ids, tiny_core

TIMEOUT_S = 1.0
HOLD_S = 1.6  # over TIMEOUT_S: a front end that counted its own stall would kill the core


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_only_silence_seen_on_schedule_counts():
    clock = _Clock()
    silence = CoreSilence(timeout_s=1.0, slack_s=0.5, clock=clock)
    for _ in range(9):  # 0.9 s of polls that found nothing: not yet
        clock.now += 0.1
        assert not silence.quiet()
    clock.now += 30.0  # the receiver itself was held up: the gap does not count
    assert not silence.quiet() and silence.silent_s == pytest.approx(0.9)
    clock.now += 0.2
    assert silence.quiet()  # 1.1 s seen on schedule
    silence.heard()
    clock.now += 0.3
    assert not silence.quiet() and silence.silent_s == pytest.approx(0.3)


def _hold_the_gil(seconds: float) -> None:
    libc = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL: no other thread of this process runs
    libc.usleep(ctypes.c_uint(int(seconds * 1e6)))


@pytest.fixture(scope="module")
def core(tiny_model_dir, redis_server, core_starter):
    """One core for the module: the hung-core test, last, leaves a restarted one."""
    client = tiny_core(tiny_model_dir, redis_server.url, "lp-silence:", core_starter,
                       restarts=RestartPolicy(3, 600.0), heartbeat_timeout_s=TIMEOUT_S)
    try:
        yield client
    finally:
        client.shutdown()


def _still_serving(client: RemoteEngineClient, pid: int, expected: list[int], request_id: str) -> None:
    time.sleep(3 * STATS_INTERVAL_S)  # the core's next pushes arrive; a death would have been declared by now
    assert client.is_healthy and client.error is None, client.error
    assert client.restarts == 0 and client.core_pid == pid
    assert greedy_ids(client, request_id) == expected


def test_a_front_end_held_up_does_not_kill_a_core_that_kept_sending(core):
    expected, pid = greedy_ids(core, "before"), core.core_pid
    for i in range(3):  # the receiver may be in its poll or just past one: a few tries reach both
        started = time.monotonic()
        _hold_the_gil(HOLD_S)
        assert time.monotonic() - started >= HOLD_S
        _still_serving(core, pid, expected, f"after-{i}")


def test_a_pause_of_both_does_not_kill_the_core(core):
    """As a paused VM: the core and the front end stop together and go on together."""
    expected, pid = greedy_ids(core, "before"), core.core_pid
    for i in range(3):
        os.kill(pid, signal.SIGSTOP)
        try:
            _hold_the_gil(HOLD_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        _still_serving(core, pid, expected, f"after-{i}")


def test_a_hung_core_is_killed_and_a_new_one_serves(core):
    expected, pid = greedy_ids(core, "before"), core.core_pid
    os.kill(pid, signal.SIGSTOP)  # the output thread too: nothing more comes from it
    started = time.monotonic()
    while core.error is None:
        assert time.monotonic() - started < TIMEOUT_S + 10, "the silent core was never declared hung"
        time.sleep(0.05)
    assert time.monotonic() - started >= TIMEOUT_S  # not before its silence reached the timeout
    assert core.error == f"the engine core sent nothing for {TIMEOUT_S:g} s"
    while not core.is_healthy:
        assert time.monotonic() - started < 120, core.error
        time.sleep(0.05)
    assert core.core_pid != pid
    assert greedy_ids(core, "after") == expected
