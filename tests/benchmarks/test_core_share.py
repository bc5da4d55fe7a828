"""The bench's view of who used the server's cores (benchmarks/profile/core_share.py), read from the real
kernel counters: a child process that burned CPU and ended within the phase still counts in the
tree (through its parent's reaped-children time), by its label while it lived."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.profile import core_share

BURN = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_child_that_burned_and_ended_within_the_phase_counts_in_the_tree():
    root = os.getpid()
    start, t0 = core_share.snapshot(root), time.perf_counter()
    subprocess.run([sys.executable, "-c", BURN], check=True)  # waited for: reaped by this process
    end, wall = core_share.snapshot(root), time.perf_counter() - t0
    share = core_share.phase_share(start, end, wall, root)
    assert share["tree_cpu_cores"] * wall >= 0.35, share
    assert share["processes"]["server"] * wall >= 0.35, share  # the root's total holds its reaped child
    assert share["cpus"] == sorted(os.sched_getaffinity(root))
    assert 0 <= share["others_on_those_cpus_cores"] <= len(share["cpus"]) + 0.1, share


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_live_child_is_in_the_tree_under_its_command_name():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while child.pid not in core_share.tree(os.getpid()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert core_share.snapshot(os.getpid()).labels[child.pid].startswith("python")
    finally:
        child.kill()
        child.wait()
