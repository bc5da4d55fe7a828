"""benchmarks.profile.thread_times: the kernel's per-thread counters of a real process, grouped by the
thread names a py-spy recording gives."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from benchmarks.profile.thread_times import phase_times, snapshot, thread_lines, thread_names

pytestmark = pytest.mark.unit


def test_a_spinning_thread_shows_cpu_and_a_sleeping_pool_shows_sleeps(tmp_path: Path) -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    def nap() -> None:
        while not stop.is_set():
            time.sleep(0.01)

    threads = [threading.Thread(target=spin, name="spinner")] + \
        [threading.Thread(target=nap, name=f"napper_{i}") for i in range(2)]
    for t in threads:
        t.start()
    try:
        before = snapshot(os.getpid())
        time.sleep(0.5)
        after = snapshot(os.getpid())
    finally:
        stop.set()
        for t in threads:
            t.join()
    pid = os.getpid()
    # py-spy's raw format: process frame, thread frame (id: name), then the code frames; count last.
    stacks = tmp_path / "phase.txt"
    stacks.write_text("".join(f'process {pid}:"python";thread ({t.native_id}): {t.name};run (x.py:1) 3\n'
                              for t in threads))
    names = thread_names(stacks)
    assert names == {t.native_id: t.name for t in threads}
    rows = {r["name"]: r for r in phase_times(before, after, names, 0.5)}
    assert rows["spinner"]["threads"] == 1 and rows["spinner"]["cpu_cores"] > 0
    assert rows["napper"]["threads"] == 2  # one pool: the trailing numbers go
    assert rows["napper"]["sleeps_per_s"] >= 10 and rows["napper"]["cpu_cores"] < rows["spinner"]["cpu_cores"]
    assert any("spinner (x1)" in line for line in thread_lines("phase", list(rows.values())))
