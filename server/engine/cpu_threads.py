"""How many intra-op threads the engine's torch uses on a CPU device (`--cpu-threads auto|N`).

`auto` counts the cores this process may run on (its affinity mask, which taskset, cgroups'
cpusets and container CPU pinning all narrow), not the machine's: a replica pinned to 8 of 64
cores that starts 64 threads oversubscribes them. It leaves one core to everything that is not
a matmul (the HTTP side's asyncio loop, JSON and SSE encoding, tokenization, the engine's own
Python) whenever there is more than one, as vLLM's CPU backend does by default.

On 2 cores that leaves 1 thread, a trade measured on the shared 2-core machine
(docs/benchmarks/cpu-vs-vllm.md). With the machine otherwise quiet, 2 threads won: 1.5x output
tokens/s in-process on the 163M-shape model, but only 1.10x over HTTP, where the event loop and
the engine thread share the cores and the GIL. With other work on the machine (load average 3.5
to 5.7) 2 threads ran 0.10x of 1 thread on both the demo and the 163M model: torch's OpenMP
threads spin-wait at every op boundary, and a step stalls until the scheduler gets round to a
descheduled one. Small machines are the shared ones (laptops, CI runners, dev VMs), so the
default takes the 10% loss over the 10x one; a dedicated 2-core box asks for `--cpu-threads 2`.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable

AUTO = "auto"
RESERVED_CORES = 1  # left to the HTTP side and the engine's Python, when there is more than one core

Affinity = Callable[[], Iterable[int]]


class CpuThreadsError(ValueError):
    """A --cpu-threads value that is neither `auto` nor a positive integer."""


def _process_affinity() -> set[int]:
    """The cores this process may run on; every core where the OS has no affinity call (macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def parse_cpu_threads(value: str | int | None) -> str | int | None:
    """`auto`, None (leave torch's own setting alone) or an int >= 1; text like "4" becomes 4."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool):  # bool is an int to Python, never a thread count
        raise CpuThreadsError(f"cpu_threads must be 'auto' or an integer >= 1, got {value!r}")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise CpuThreadsError(f"cpu_threads must be 'auto' or an integer >= 1, got {value!r}") from None
    if not isinstance(value, int) or value < 1:
        raise CpuThreadsError(f"cpu_threads must be 'auto' or an integer >= 1, got {value!r}")
    return value


def auto_threads(cores: int) -> int:
    """The `auto` policy for a process allowed on `cores` cores."""
    if cores < 1:
        raise CpuThreadsError(f"an affinity mask has at least one core, got {cores}")
    return max(1, cores - RESERVED_CORES)


def resolve_cpu_threads(value: str | int | None, affinity: Affinity = _process_affinity) -> int | None:
    """The thread count to give torch, or None to leave it as it is. Explicit counts are honoured
    as given, even above the affinity mask: the operator may know better (e.g. SMT siblings)."""
    setting = parse_cpu_threads(value)
    if setting == AUTO:
        return auto_threads(len(set(affinity())))
    return setting
