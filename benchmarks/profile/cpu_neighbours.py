"""Which processes on the machine used the CPU during a bench phase (Linux /proc): a server pinned to a
core still shares it with every unpinned process of other users, and on a shared machine those, not the
server's own work, can decide a latency. Each row: CPU-seconds per wall-second, the cores the process
may run on, and its command line (cut short)."""
from __future__ import annotations

import os

from server.bench.proc_stat import all_stat_fields, cmdline, cpu_s

CMDLINE_CHARS = 80


def snapshot() -> dict[int, int]:
    """pid -> seconds of user + system CPU so far, for every process now."""
    return {pid: cpu_s(fields) for pid, fields in all_stat_fields().items()}


def busiest(before: dict[int, int], after: dict[int, int], wall_s: float, top: int = 8) -> list[dict]:
    """The `top` processes by CPU between two snapshots `wall_s` apart (those still alive at the end)."""
    assert wall_s > 0, wall_s
    used = sorted(((after[p] - before.get(p, after[p]), p) for p in after), reverse=True)[:top]
    rows = []
    for seconds, pid in used:
        if seconds <= 0:
            break
        try:
            cmd = cmdline(pid)
            cores = sorted(os.sched_getaffinity(pid))
        except OSError:
            continue
        rows.append({"pid": pid, "cpu_cores": round(seconds / wall_s, 3), "cores": cores,
                     "command": cmd[:CMDLINE_CHARS]})
    return rows


def neighbour_lines(name: str, rows: list[dict]) -> list[str]:
    lines = [f"  {name}: busiest processes on the machine (CPU-s per wall-s, allowed cores, command)"]
    lines += [f"    {r['cpu_cores']:6.3f}  {','.join(map(str, r['cores'])):>5}  {r['command']}" for r in rows]
    return lines
