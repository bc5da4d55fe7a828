"""Pinning (Linux) a thread or a whole process onto a set of cores (server.cpu_placement decides which).

os.sched_setaffinity(0, ...) moves the calling thread only; threads and processes it starts later
inherit its mask. A process that already runs threads is moved task by task (/proc/PID/task).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


def pin_thread(cores: tuple[int, ...] | None) -> None:
    """The calling thread (and what it starts afterwards) onto `cores`; None: leave it."""
    if cores:
        os.sched_setaffinity(0, cores)


def pin_process(pid: int, cores: tuple[int, ...] | None) -> None:
    """Every thread process `pid` runs now onto `cores` (threads it starts later inherit); None: leave it."""
    if not cores:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cores)
