"""Linux `/proc/<pid>/stat` as the benches read it: one parse of its fields, every live process's
fields at once, a process's CPU time and command line. The command name in a stat line is in
parentheses and may hold spaces or parentheses itself, so the fields are those after the last ")"."""
from __future__ import annotations

import os
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PPID, UTIME, STIME, CUTIME, CSTIME = 1, 11, 12, 13, 14  # indexes into stat_fields (stat(5) fields 4, 14-17)


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name. Raises OSError when the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def all_stat_fields() -> dict[int, list[str]]:
    """pid -> stat_fields for every process now (one that ends while read is left out)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = stat_fields(entry.name)
            except OSError:
                continue
    return found


def cpu_s(fields: list[str], reaped_children: bool = False) -> float:
    """User + system CPU seconds of a process (all its threads) from its stat fields; with
    `reaped_children`, plus that of the children it has waited for."""
    end = CSTIME if reaped_children else STIME
    return sum(int(f) for f in fields[UTIME:end + 1]) * TICK_S


def cmdline(pid: int) -> str:
    """The process's command line, its arguments joined by spaces. Raises OSError when it is gone."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
