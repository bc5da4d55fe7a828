"""What each thread of a server did with the wall time of a bench phase, from the kernel's own
counters (Linux `/proc/<pid>/task/<tid>/schedstat` and `status`): seconds on a CPU, seconds runnable
but waiting for one (the core was busy with another thread or process), and how often it went to sleep
(voluntary context switches: a blocking call, a lock, the GIL) or was preempted.

A py-spy profile (benchmarks.profile.server_profile) samples stacks, and a thread that is runnable but not
running looks on-CPU to it; these counters separate the two, so "the engine thread got 40% of its core"
and "the engine thread waited 50% of the phase for its core" can be told apart. Thread names come from
the py-spy recording of the same phase (its frames name each thread by id), since Python does not
give its threads OS names."""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from benchmarks.profile.server_profile import read_stacks

_THREAD_FRAME = re.compile(r"^thread \((\d+)\): (.*)$")


def snapshot(pid: int) -> dict[int, tuple[int, int, int, int]]:
    """tid -> (ns on a CPU, ns runnable waiting for one, voluntary switches, involuntary switches) for
    every thread of `pid` now; threads that end while read are left out."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            on_cpu, waiting, _ = (int(x) for x in (task / "schedstat").read_text().split())
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines()
                          if ":\t" in line)
        except (OSError, ValueError):
            continue
        found[int(task.name)] = (on_cpu, waiting, int(status["voluntary_ctxt_switches"]),
                                 int(status["nonvoluntary_ctxt_switches"]))
    return found


def thread_names(stacks_path: Path) -> dict[int, str]:
    """tid -> Python thread name, from a raw py-spy recording (`--threads`)."""
    names = {}
    for frames, _ in read_stacks(stacks_path):
        for f in frames:
            m = _THREAD_FRAME.match(f)
            if m:
                names[int(m.group(1))] = m.group(2)
    return names


def phase_times(before: dict, after: dict, names: dict[int, str], wall_s: float) -> list[dict]:
    """Per thread group (a name without its trailing number: the worker threads of one pool together),
    over a phase of `wall_s` seconds: threads, CPU-seconds and runnable-waiting seconds per wall-second,
    and sleeps and preemptions per second; busiest first."""
    assert wall_s > 0, wall_s
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for tid, (cpu, wait, vol, invol) in after.items():
        cpu0, wait0, vol0, invol0 = before.get(tid, (0, 0, 0, 0))
        name = re.sub(r"[_\s]*[\d_]+$", "", names.get(tid, "unnamed (not seen by py-spy)"))
        g = groups[name]
        g[0] += 1
        g[1] += (cpu - cpu0) / 1e9
        g[2] += (wait - wait0) / 1e9
        g[3] += vol - vol0
        g[4] += invol - invol0
    rows = [{"threads": int(n), "name": name, "cpu_cores": round(cpu / wall_s, 3),
             "runnable_waiting": round(wait / wall_s, 3), "sleeps_per_s": round(vol / wall_s, 1),
             "preempted_per_s": round(invol / wall_s, 1)}
            for name, (n, cpu, wait, vol, invol) in groups.items()]
    return sorted(rows, key=lambda r: -(r["cpu_cores"] + r["runnable_waiting"]))


def thread_lines(name: str, rows: list[dict]) -> list[str]:
    """A phase's thread times as printable lines."""
    lines = [f"  {name}: per thread group, CPU-s / runnable-waiting-s per wall-s, sleeps/s, preemptions/s"]
    for r in rows:
        lines.append(f"    {r['cpu_cores']:6.3f} {r['runnable_waiting']:6.3f} {r['sleeps_per_s']:8.1f} "
                     f"{r['preempted_per_s']:7.1f}  {r['name']} (x{r['threads']})")
    return lines
