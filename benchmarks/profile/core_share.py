"""Who used the server's cores through a bench phase (Linux /proc): the CPU time of the server's
whole process tree (its own threads, its child processes, and children that ended within the phase,
through their parent's reaped-children time), and how busy the CPUs the server may run on were, so
that what other processes on the machine took of them is told apart from what the server did.
Per-thread times are benchmarks.profile.thread_times'."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from server.bench.proc_stat import PPID, TICK_S, all_stat_fields, cmdline, cpu_s, stat_fields


@dataclass(frozen=True)
class Snapshot:
    process_cpu_s: dict[int, float]    # by pid: its own CPU (live and ended threads) + its reaped children's
    labels: dict[int, str]             # by pid: what the process is (see _label)
    cpu_busy_s: dict[int, float]       # by CPU number, of those the root may run on: non-idle time
    cpus: tuple[int, ...]              # the CPUs the root may run on


# server.engine.core.process.PROCESS_NAME (its comm): importing that module would load torch into every
# bench client process; tests/benchmarks/test_victim_harness_engine_core.py holds the two equal.
ENGINE_CORE_PROCESS = "loraplex-core"


def engine_core_pid(server: int) -> int | None:
    """The engine-core process under `server` (--engine-process separate), None in-process."""
    for pid in tree(server)[1:]:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == ENGINE_CORE_PROCESS:
                return pid
    return None


def tree(root: int) -> list[int]:
    """`root` and its descendants, alive now."""
    parents: dict[int, list[int]] = {}
    for pid, fields in all_stat_fields().items():
        parents.setdefault(int(fields[PPID]), []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += parents.get(pid, [])
    return found


def _cpu_busy_s(cpus: tuple[int, ...]) -> dict[int, float]:
    busy = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
            busy[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4]) * TICK_S
    return busy


def _label(pid: int, root: int) -> str:
    """'server', 'redis-server', 'fork server' (multiprocessing's, for grammar compiles), 'forked
    processes' (its children: compile processes), else the process's command name."""
    if pid == root:
        return "server"
    if "multiprocessing.forkserver" in cmdline(pid):
        return "fork server" if int(stat_fields(pid)[PPID]) == root else "forked processes"
    return Path(f"/proc/{pid}/comm").read_text().strip()


def snapshot(root: int) -> Snapshot:
    """The tree's processes and the root's CPUs now (a process that ends while read is left out)."""
    process_cpu, labels = {}, {}
    for pid in tree(root):
        with contextlib.suppress(OSError, IndexError, ValueError):
            process_cpu[pid] = cpu_s(stat_fields(pid), reaped_children=True)
            labels[pid] = _label(pid, root)
    cpus = tuple(sorted(os.sched_getaffinity(root)))
    return Snapshot(process_cpu, labels, _cpu_busy_s(cpus), cpus)


def tree_cpu_s(snap: Snapshot) -> float:
    return sum(snap.process_cpu_s.values())


def phase_share(start: Snapshot, end: Snapshot, wall_s: float, root: int) -> dict:
    """Per wall-second of the phase: the tree's CPU, its child processes' part of it, and the root's
    CPUs' busy time with what the rest of the machine took of them."""
    assert wall_s > 0, wall_s
    per_s = lambda x: round(x / wall_s, 3)  # noqa: E731
    # a process that ended within the phase is in its parent's reaped-children time at the end
    tree = tree_cpu_s(end) - tree_cpu_s(start)
    by_label: dict[str, float] = {}
    for pid, cpu in end.process_cpu_s.items():
        label = end.labels[pid]
        by_label[label] = by_label.get(label, 0.0) + cpu - start.process_cpu_s.get(pid, 0.0)
    # what processes that ended took before the phase began: in their reaper's total at the end
    gone = sum(cpu for pid, cpu in start.process_cpu_s.items() if pid not in end.process_cpu_s)
    if gone:
        by_label["(ended processes' earlier CPU)"] = -gone
    busy = sum(end.cpu_busy_s.get(c, 0.0) - start.cpu_busy_s.get(c, 0.0) for c in end.cpus)
    return {"tree_cpu_cores": per_s(tree), "processes": {k: per_s(v) for k, v in sorted(by_label.items())},
            "cpus": list(end.cpus), "cpus_busy_cores": per_s(busy),
            "others_on_those_cpus_cores": per_s(max(0.0, busy - tree))}
