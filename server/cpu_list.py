"""Core lists: the text form `--engine-cpus` and `--api-cpus` take ("0", "1-3", "0,2-3"), as
/proc/PID/status's Cpus_allowed_list writes it, and the cores this process may use. No torch import:
the serve command's config reads them before anything heavy loads."""
from __future__ import annotations

import os

Cpus = tuple[int, ...]


class CpuListError(ValueError):
    """A core list that is not `N`, `N-M` or a comma-separated mix of them."""


def parse_cpu_list(text: str) -> Cpus:
    """"0,2-3" -> (0, 2, 3): sorted, each core once; empty or malformed text raises CpuListError."""
    cores: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise CpuListError(f"{text!r} is not a core list like 0, 1-3 or 0,2-3") from None
        if lo < 0 or hi < lo:
            raise CpuListError(f"{text!r} is not a core list like 0, 1-3 or 0,2-3 ({part.strip()!r})")
        cores.update(range(lo, hi + 1))
    return tuple(sorted(cores))


def format_cpu_list(cores: Cpus) -> str:
    """(0, 2, 3) -> "0,2-3", as /proc/PID/status's Cpus_allowed_list writes it."""
    runs: list[str] = []
    for core in sorted(cores):
        if runs and core == _run_end(runs[-1]) + 1:
            runs[-1] = f"{runs[-1].split('-')[0]}-{core}"
        else:
            runs.append(str(core))
    return ",".join(runs)


def _run_end(run: str) -> int:
    return int(run.rsplit("-", 1)[-1])


def allowed_cpus() -> Cpus:
    """The cores this thread may run on (every core where the OS has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))
