"""benchmarks.profile.cpu_neighbours: a real busy process shows up among the machine's busiest, with the
cores it may run on and its command line."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.profile.cpu_neighbours import busiest, neighbour_lines, snapshot


def test_a_spinning_process_is_among_the_busiest_with_its_cores() -> None:
    core = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {%d})\n"
                                "while True: pass" % core])
    try:
        time.sleep(0.3)  # pinned and spinning by now
        before = snapshot()
        time.sleep(1.0)
        rows = busiest(before, snapshot(), 1.0, top=50)
    finally:
        spinner.kill()
        spinner.wait()
    mine = [r for r in rows if r["pid"] == spinner.pid]
    assert mine, rows
    assert mine[0]["cores"] == [core] and mine[0]["cpu_cores"] > 0 and "sched_setaffinity" in mine[0]["command"]
    assert [r["cpu_cores"] for r in rows] == sorted((r["cpu_cores"] for r in rows), reverse=True)
    assert any("sched_setaffinity" in line for line in neighbour_lines("p", rows))
