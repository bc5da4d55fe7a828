"""Which processes on the machine used the CPU during a bench phase (Linux /proc): a server pinned to a
core still shares it with every unpinned process of other users, and on a shared machine those, not the
server's own work, can decide a latency. Each row: CPU-seconds per wall-second, the cores the process
may run on, and its command line (cut short)."""
from __future__ import annotations

import os
from pathlib import Path

CMDLINE_CHARS = 80


def snapshot() -> dict[int, int]:
    """pid -> clock ticks of user + system CPU so far, for every process now."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(stat.parent.name)] = int(fields[11]) + int(fields[12])
    return found


def busiest(before: dict[int, int], after: dict[int, int], wall_s: float, top: int = 8) -> list[dict]:
    """The `top` processes by CPU between two snapshots `wall_s` apart (those still alive at the end)."""
    assert wall_s > 0, wall_s
    tick = os.sysconf("SC_CLK_TCK")
    used = sorted(((after[p] - before.get(p, after[p]), p) for p in after), reverse=True)[:top]
    rows = []
    for ticks, pid in used:
        if ticks <= 0:
            break
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            cores = sorted(os.sched_getaffinity(pid))
        except OSError:
            continue
        rows.append({"pid": pid, "cpu_cores": round(ticks / tick / wall_s, 3), "cores": cores,
                     "command": cmd[:CMDLINE_CHARS]})
    return rows


def neighbour_lines(name: str, rows: list[dict]) -> list[str]:
    lines = [f"  {name}: busiest processes on the machine (CPU-s per wall-s, allowed cores, command)"]
    lines += [f"    {r['cpu_cores']:6.3f}  {','.join(map(str, r['cores'])):>5}  {r['command']}" for r in rows]
    return lines
