"""Pinning a bench's parts to cores (Linux), so a victim and a storm run side by side on cores of
their own where the machine has two: os.sched_setaffinity(0, ...) pins the calling thread only, and
threads and processes it starts afterwards inherit its mask."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from server.bench.proc_stat import PPID, all_stat_fields


def two_cores() -> tuple[int, int] | None:
    """(victim core, storm core): the first two this process may run on; None with fewer."""
    cores = sorted(os.sched_getaffinity(0))
    return (cores[0], cores[1]) if len(cores) >= 2 else None


def pin_thread(core: int | None) -> None:
    """Pin the calling thread (None: leave it)."""
    if core is not None:
        os.sched_setaffinity(0, {core})


def pin_cpus(cpus: tuple[int, ...] | None, nice: int = 0) -> None:
    """Run the calling process on `cpus` (an attacker pool's initializer); None or empty: anywhere. With
    `nice` > 0, at that lower priority: client processes standing in for other machines then take only
    the CPU the server leaves (a 2-core bench has no other machine to put them on)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if nice:
        os.nice(nice)


@contextlib.contextmanager
def pinned(cores: int | tuple[int, ...] | None) -> Iterator[None]:
    """The calling thread on `cores` (one or several) for the block (what it starts there inherits it),
    then back; None: left as it is."""
    before = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, {cores} if isinstance(cores, int) else set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a server's Redis child, its loader processes)."""
    return [child for child, fields in all_stat_fields().items() if int(fields[PPID]) == pid]


def pin_process(pid: int, core: int) -> None:
    """Every thread of process `pid` onto `core` (threads it starts later inherit the mask)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), {core})
