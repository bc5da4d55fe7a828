"""The benches' /proc reader (server/bench/proc_stat.py) against real processes: a child's parent,
command line and CPU time, one whose command name holds a space and a parenthesis included."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.profile.cpu_pinning import children
from server.bench.proc_stat import PPID, all_stat_fields, cmdline, cpu_s, stat_fields

# a command name with a space and parentheses: it would split a naive parse of the stat line
BURN = ("import time\nopen('/proc/self/comm', 'w').write('burn (x) y')\n"
        "end = time.time() + 30\nwhile time.time() < end: pass\n")


def test_a_burning_child_is_found_with_its_command_and_its_growing_cpu_time():
    child = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{child.pid}/comm").read().strip() != "burn (x) y":
            assert time.monotonic() < deadline and child.poll() is None, "the child never renamed itself"
            time.sleep(0.01)
        first = cpu_s(stat_fields(child.pid))
        time.sleep(0.5)
        fields = all_stat_fields()[child.pid]
        assert int(fields[PPID]) == os.getpid()
        assert cpu_s(fields) > first
        assert child.pid in children(os.getpid())
        assert cmdline(child.pid).startswith(sys.executable) and "import time" in cmdline(child.pid)
    finally:
        child.kill()
        child.wait()
    assert child.pid not in all_stat_fields()
