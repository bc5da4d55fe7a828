"""The reserved engine core (server.engine.core.reserved): forked where no thread exists, released (it
exits 0) by its holder, or by the CoreStarter it was handed when that closes untaken; not forked at all
once a thread runs. A served core forked by `serve` and taken by its starter end to end:
tests/server/test_cpu_placement_serve.py."""
from __future__ import annotations

import subprocess
import sys

from tests.repo import ROOT_DIR

SCRIPT = """
import threading
from server.engine.core.launcher import CoreStarter
from server.engine.core.reserved import reserve_core

core = reserve_core()
assert core is not None and core.poll() is None, core
core.release()  # never started: the child reads end-of-file
print("released", core.returncode)
untaken = reserve_core()
CoreStarter(untaken).close()
print("untaken", untaken.returncode)
stop = threading.Event()
threading.Thread(target=stop.wait).start()
print("with a thread", reserve_core())
stop.set()
"""


def test_a_reserved_core_is_forked_released_and_skipped_where_a_thread_runs():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT_DIR, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["released 0", "untaken 0", "with a thread None"]
