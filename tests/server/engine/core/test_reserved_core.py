"""The reserved engine core (server.engine.core.reserved): forked where no thread exists, released (it
exits 0) when nothing takes it, not forked at all once a thread runs; spawn_core takes it. A served
core forked by `serve` end to end: tests/server/test_cpu_placement_serve.py."""
from __future__ import annotations

import subprocess
import sys

from tests.repo import ROOT_DIR

SCRIPT = """
import threading
from server.engine.core.reserved import RESERVATION, reserve_core

with reserve_core():
    core = RESERVATION.take()
    assert core is not None and core.poll() is None, core
    core.release()  # never started: the child reads end-of-file
    print("released", core.returncode)
with reserve_core():
    untaken = RESERVATION.take()
    RESERVATION.hold(untaken)
print("untaken", untaken.returncode, RESERVATION.take())  # released on the way out
stop = threading.Event()
threading.Thread(target=stop.wait).start()
with reserve_core():
    print("with a thread", RESERVATION.take())
stop.set()
"""


def test_a_reserved_core_is_forked_released_and_skipped_where_a_thread_runs():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT_DIR, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["released 0", "untaken 0 None", "with a thread None"]
