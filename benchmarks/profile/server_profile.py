"""Where a server's CPU goes while a bench phase runs: `py-spy` samples the server process and the
processes it started (grammar compiles, adapter loaders) from outside, without touching its code, and
each on-CPU sample is attributed to a category that names who spent it: the engine thread by the
phase of `LLMEngine.step` it was in, the event loop and worker threads by the deepest `server/api/`
file on the stack (the route or middleware doing the work), child processes by what they run.

A missed latency target is explained by these numbers: the victim's step waits for whatever else
holds the server's core or its GIL, and the table says what that was and for how many CPU-seconds
per wall-second. Samples are taken without `--idle`, so a thread blocked on a lock, a socket or the
GIL is not counted: the shares are of CPU actually spent."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ENGINE_THREAD = "loraplex-engine"
ENGINE_STEP_FRAME = "LLMEngine.step ("
SLOT_LOAD_FRAME = "Scheduler._acquire_slot ("
API_FILE_MARK = "/server/api/"


def py_spy() -> str | None:
    """The py-spy executable: on PATH or beside this interpreter (the venv's bin), else None."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@dataclass
class Sampler:
    """`with Sampler(pid, out):` records the process `pid` and its children at `rate` Hz into `out`
    (py-spy's raw collapsed-stack format, one line per distinct stack with its sample count)."""
    pid: int
    out: Path
    rate: int = 100
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        assert self.rate > 0, self.rate

    def __enter__(self) -> "Sampler":
        exe = py_spy()
        if exe is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy): --profile needs it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.unlink(missing_ok=True)
        # --nonblocking: the server is never paused, so sampling does not move the latencies measured.
        self._proc = subprocess.Popen(
            [exe, "record", "--pid", str(self.pid), "--rate", str(self.rate), "--format", "raw",
             "--threads", "--subprocesses", "--nonblocking", "--full-filenames", "--output", str(self.out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.2)  # attached before the phase's traffic starts
        if self._proc.poll() is not None:
            raise RuntimeError(f"py-spy could not attach to {self.pid}: {self._proc.stderr.read().strip()}")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    """Each stack in a raw py-spy file (outermost frame first) with its sample count."""
    stacks = []
    if not path.exists():
        return stacks
    for line in path.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if frames and count.isdigit():
            stacks.append((frames.split(";"), int(count)))
    return stacks


def category(frames: list[str], engine_core: int | None = None) -> str:
    """Who spent one sample: see the module docstring. `frames` is one raw stack, outermost first,
    beginning with its process frame(s) and its thread frame. `engine_core`: the pid of the server's
    engine-core process (--engine-process separate), whose samples are named as the engine thread's are
    (its step loop is its main thread) or by their thread."""
    processes = [f for f in frames if f.startswith("process ")]
    code = [f for f in frames if not f.startswith(("process ", "thread ("))]
    thread = next((f.split("): ", 1)[1] for f in frames if f.startswith("thread (") and "): " in f), "?")
    if engine_core is not None and len(processes) > 1 and processes[-1].startswith(f"process {engine_core}:"):
        if thread == "MainThread":
            return "engine core: " + _step_part(code)
        return "engine core: thread " + thread.rstrip("_0123456789 ")
    if len(processes) > 1:  # a process the server started
        for mark, name in (("/grammar_worker.py:", "child: grammar compile"),
                           ("/loader_worker.py:", "child: adapter loader")):
            if any(mark in f for f in code):
                return name
        return "child: other"
    if thread == ENGINE_THREAD:
        return "engine: " + _step_part(code)
    api = [f for f in code if API_FILE_MARK in f]
    where = _file(api[-1]) if api else "framework (uvicorn, starlette, asyncio)"
    who = "event loop" if thread == "MainThread" else "thread " + thread.rstrip("_0123456789 ")
    return f"{who}: {where}"


def _step_part(code: list[str]) -> str:
    """The part of the step loop one sample of the engine's thread was in: a copy into an adapter slot
    (what a storm of new adapters adds to a step), else the call below `LLMEngine.step` and its LLMEngine
    wrappers (schedule, the runner, postprocessing), else what the loop did between steps."""
    if any(f.startswith(SLOT_LOAD_FRAME) for f in code):
        return "slot load (Scheduler._acquire_slot)"
    for i, f in enumerate(code):
        if f.startswith(ENGINE_STEP_FRAME):
            below = next((g for g in code[i + 1:] if not g.startswith("LLMEngine.")), f)
            return below.split(" (", 1)[0]
    stats = next((f for f in code if f.startswith("LLMEngine.stats (")), None)
    return "LLMEngine.stats (snapshot between steps)" if stats else "outside step"


def _file(frame: str) -> str:
    """'f (/repo/server/api/openai_routes.py:12)' -> 'api/openai_routes.py'."""
    path = frame.rsplit(" (", 1)[-1].rstrip(")").rsplit(":", 1)[0]
    return path[path.index(API_FILE_MARK) + len("/server/"):]


def summarize(path: Path, wall_s: float, rate: int, top: int = 12, engine_core: int | None = None) -> dict:
    """The categories' CPU in one recorded phase: samples, CPU-seconds per wall-second (1.0 = one core
    busy all the phase) and share of all samples, largest first; the rest folded into 'other'.
    `engine_core`: the engine-core process's pid (see category)."""
    counts: Counter = Counter()
    for frames, n in read_stacks(path):
        counts[category(frames, engine_core)] += n
    total = sum(counts.values())
    ranked = counts.most_common()
    shown, rest = ranked[:top], sum(n for _, n in ranked[top:])
    if rest:
        shown.append(("other (smaller categories)", rest))
    cores = lambda n: round(n / rate / wall_s, 3) if wall_s > 0 else None  # noqa: E731
    return {"samples": total, "rate_hz": rate, "wall_s": round(wall_s, 2), "cpu_cores": cores(total),
            "by_category": [{"category": c, "samples": n, "cpu_cores": cores(n),
                             "share": round(n / total, 4) if total else 0.0} for c, n in shown]}


def profile_lines(name: str, summary: dict) -> list[str]:
    """A phase's profile as printable lines."""
    # py-spy counts a thread that is runnable but waiting for a core as active: on a busy core these
    # "cores" exceed what the server got (benchmarks.profile.thread_times has the kernel's split)
    lines = [f"  {name}: py-spy {summary['cpu_cores']} threads running or runnable over {summary['wall_s']} s "
             f"({summary['samples']} samples at {summary['rate_hz']} Hz)"]
    for row in summary["by_category"]:
        lines.append(f"    {row['share'] * 100:5.1f}%  {row['cpu_cores']:6.3f} cores  {row['category']}")
    return lines


def can_profile() -> str | None:
    """None when this machine can sample another process, else why not."""
    if py_spy() is None:
        return "py-spy is not installed"
    if sys.platform != "linux":
        return "py-spy sampling is used on Linux only"
    if os.geteuid() != 0 and Path("/proc/sys/kernel/yama/ptrace_scope").exists() and \
            Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip() not in ("0",):
        return "ptrace of a non-child process is restricted (kernel.yama.ptrace_scope); run as root"
    return None
