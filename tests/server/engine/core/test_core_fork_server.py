"""The core fork server (server.engine.core.fork_server): a core forked from it gets its launch as
msgpack bytes, reports its exit status, and does not import the caller's main module again (a user's
unguarded script); FrontEndWatch sees the front end exit whoever the core's parent is. Served cores
from it end to end (kill -9 included): tests/server/api/test_api_engine_process.py, _restart.py."""
from __future__ import annotations

import subprocess
import sys

from server.engine.core.front_end_watch import FrontEndWatch
from tests.repo import ROOT_DIR

# No `if __name__ == "__main__"` guard, on purpose: a child that re-imported it would print twice.
SCRIPT = """
import os
from server.engine.core.fork_server import CoreForkServer

print("main", os.getpid(), flush=True)
server = CoreForkServer()
first = server.start(b"not a launch")
second = server.start(b"\\x01")
print("codes", first.wait(120), second.wait(120), first.poll(), first.pid != second.pid != os.getpid())
"""


def test_a_forked_core_reports_its_status_and_leaves_the_main_module_alone():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT_DIR, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len([line for line in lines if line.startswith("main ")]) == 1, lines
    assert lines[-1] == "codes 1 1 1 True", lines
    assert done.stderr.count("Traceback") == 2, done.stderr  # each core said why it could not start


def test_front_end_watch_sees_the_process_exit():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = FrontEndWatch(proc.pid)
        assert not watch.gone()
        proc.kill()
        proc.wait()
        assert watch.gone()
    finally:
        proc.kill()
