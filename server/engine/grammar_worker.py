"""Grammar compilation under a hard deadline on the compile's own CPU time, in child processes.

xgrammar cannot be interrupted once it compiles (a 20,000-value enum took 275 s on the
2-core dev machine), so a compile that passes its deadline is ended the only sure way:
its process is killed. The deadline counts the CPU time the compile process spends, not
the wall-clock time the request waits: on a loaded machine (and compile processes run
below the engine's priority) a cheap schema starved of CPU would pass a wall-clock deadline
and be refused for the machine's sake, not its own. A wall-clock cap, WALL_CAP_FACTOR times
the budget, is the backstop for a process that makes no progress at all.

The pool keeps SPARE_PROCESSES started beyond the compiles running (at most `processes`), so a
killed process's replacement starts in the background (forked from a fork server that has
imported xgrammar once, then loading the tokenizer) while a warm spare takes the next compile. The result comes back serialised and
is bound to the engine's tokenizer in this process (Grammars.deserialize). Callers block (run
`compile` off the event loop and off the engine thread); at most `processes` compiles run at
once, the rest wait for a free slot, in fair turns by tenant (server.tenant_share): one tenant's
compiles never hold every process, so a flood of slow schemas leaves a process for everyone else.
"""
from __future__ import annotations

import multiprocessing
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import psutil

from server.engine.grammar import GrammarError, Grammars, compile_constraint, refuse_from_text
from server.engine.structured_outputs import StructuredOutputsParams
from server.tenant_share import TenantShare

START_TIMEOUT_S = 180.0  # the first process waits for the fork server to import xgrammar (and torch)
# Compile processes run at a lower CPU priority than the engine: on a machine with few cores, a
# flood of slow schemas (and the imports of each replacement for a killed process) then takes
# the cycles the engine leaves, not the ones other tenants' decode steps need.
COMPILE_NICENESS = 10
# The wall-clock backstop as a multiple of the CPU budget: at niceness 10 a compile sharing a
# core with one busy process at niceness 0 gets about a tenth of it.
WALL_CAP_FACTOR = 10
SPARE_PROCESSES = 1
_CPU_TICK_S = 0.01  # the kernel's CPU-time accounting step (USER_HZ 100): no finer wait helps


class GrammarTimeout(GrammarError):
    """The constraint did not compile within its CPU budget, or within the wall-clock cap (its compile was killed)."""

    def __init__(self, limit_ms: int, wall_cap_ms: int | None = None) -> None:
        if wall_cap_ms is None:
            super().__init__(f"the constraint did not compile within {limit_ms} ms of CPU time")
        else:
            super().__init__(f"the constraint did not compile within the {wall_cap_ms} ms wall-clock cap")
        self.limit_ms = limit_ms
        self.wall_cap_ms = wall_cap_ms


class GrammarCompilerBusy(RuntimeError):
    """Every compile process stayed busy for as long as a request may wait for one."""


def _serve(conn: Connection, tokenizer_info_json: str) -> None:
    """The child's loop: a StructuredOutputsParams in, ("ok", serialised grammar) or ("error", why) out."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        conn.send("ready")
        while True:
            spec = conn.recv()
            try:
                conn.send(("ok", compile_constraint(compiler, spec).serialize_json()))
            except GrammarError as e:
                conn.send(("error", str(e)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the server stopped (or closed this worker): done
        return


def _lower_this_thread() -> None:
    """This thread (one that only starts a compile process) to COMPILE_NICENESS. The first process
    started launches multiprocessing's fork server, which inherits the niceness of the thread that
    forks it (on Linux niceness is per thread) and imports xgrammar and torch: seconds of CPU right
    after the server is ready, which must not compete with requests at the engine's priority. The
    children it forks then start at COMPILE_NICENESS too."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
        except OSError:  # not allowed to change it: the child's own renice below still applies
            pass


class _Process:
    def __init__(self, ctx, tokenizer_info_json: str, cpus: tuple[int, ...] | None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, tokenizer_info_json), daemon=True,
                                name="loraplex-grammar-compiler")
        self.proc.start()
        try:  # at once, so the child's imports already run at the lower priority
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, COMPILE_NICENESS)
        except OSError:  # the child is gone already: its first message says so
            pass
        if cpus:  # forked from the fork server, which has whatever mask its starter had
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self.proc.pid, cpus)
        child.close()
        self._ps = psutil.Process(self.proc.pid)

    def wait_ready(self) -> None:
        if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv() != "ready":
            raise GrammarCompilerBusy("a grammar compile process did not start")

    def cpu_seconds(self) -> float:
        """CPU time the process has spent (user and system, all its threads); EOFError once it is gone."""
        try:
            t = self._ps.cpu_times()
        except psutil.Error:
            raise EOFError("the grammar compile process is gone") from None
        return t.user + t.system

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class GrammarCompileService:
    """Compiles for `grammars` (the engine's cache) in up to `processes` child processes at once,
    each compile killed past `timeout_ms` of its CPU time (or `wall_cap_ms` of wall-clock time).
    Started lazily, or with `prestart` (one process, in the background) so that the first
    constraint does not wait for the fork server's imports."""

    def __init__(self, grammars: Grammars, timeout_ms: int, processes: int = 2,
                 wait_s: float | None = None, wall_cap_ms: int | None = None,
                 spares: int = SPARE_PROCESSES, cpus: tuple[int, ...] | None = None) -> None:
        """`cpus`: the cores each compile process runs on (server.cpu_placement); None: not pinned."""
        assert timeout_ms > 0 and processes > 0 and spares >= 0
        self.grammars = grammars
        self._cpus = cpus
        self.timeout_ms = timeout_ms
        self.wall_cap_ms = wall_cap_ms if wall_cap_ms is not None else WALL_CAP_FACTOR * timeout_ms
        assert self.wall_cap_ms > 0
        # A waiting request gives up after this long (others' compiles end by their wall-clock cap).
        self.wait_s = wait_s if wait_s is not None else START_TIMEOUT_S + 2 * self.wall_cap_ms / 1000
        self._info_json = grammars.info.serialize_json()
        # Children fork from multiprocessing's fork server, a single-threaded process that imported
        # this module (xgrammar, torch) and the main module once: a replacement then starts in tens
        # of ms, not the ~10 s of CPU a spawn spends on those imports; and no child is forked from
        # this process's threads.
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["__main__", __name__])
        # A tenant takes at most all processes but one: another tenant's compile never waits for a
        # flood's deadline-hitting compiles to end.
        self._slots = TenantShare[threading.Event](processes, max(1, processes - 1))
        self._spares = spares
        self._pool_size = processes + spares
        # Processes the pool keeps: the most compiles seen at once plus the spares (grown lazily,
        # so a server whose compiles come one at a time keeps two processes, not all).
        self._target = 0
        self._ready: list[_Process] = []  # started and idle
        self._starting = 0
        self._busy = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.timeouts = 0
        self.cold_starts = 0  # compiles that had to wait for a process to start
        self._running = 0  # compiles asked for and not yet answered (waiting for a process, or compiling)
        self._closed = False

    @property
    def running(self) -> int:
        with self._lock:
            return self._running

    @property
    def all_started(self) -> bool:
        """Whether the pool is at its size with no process starting (a killed one has been replaced)."""
        with self._lock:
            return self._starting == 0 and len(self._ready) + self._busy == self._target

    @property
    def idle_processes(self) -> int:
        """Processes started and waiting for a compile."""
        with self._lock:
            return len(self._ready)

    def prestart(self) -> None:
        """Start one process now, in the background (the fork server with it, which imports xgrammar and
        torch at COMPILE_NICENESS): the first compile then takes it warm. Returns at once; a compile
        asked for before it is ready waits for it as a cold start."""
        with self._lock:
            self._target = max(self._target, 1)
            self._top_up()

    def compile(self, spec: StructuredOutputsParams, owner: str = "",
                spent: Callable[[float], None] | None = None):
        """The compiled grammar (from the cache when it can); GrammarError / GrammarTimeout say why not.
        `owner`: the tenant asking (its share of the processes); `spent`: told the seconds a process
        spent on this compile, whatever its outcome (nothing for a cached one)."""
        cached = self.grammars.lookup(spec)
        if cached is not None:
            return cached
        try:
            refuse_from_text(spec)  # in this process: a refusal from the text alone costs no compile process
        except GrammarError:
            self.grammars.count_failure()
            raise
        with self._lock:
            self._running += 1
        try:
            return self._compile(spec, owner, spent)
        finally:
            with self._lock:
                self._running -= 1

    def _top_up(self) -> None:
        """Start processes in the background until the pool is at its size (the lock held)."""
        while not self._closed and len(self._ready) + self._starting + self._busy < self._target:
            self._starting += 1
            threading.Thread(target=self._start_one, daemon=True, name="loraplex-grammar-start").start()

    def _start_one(self) -> None:
        _lower_this_thread()
        proc = None
        try:
            proc = _Process(self._ctx, self._info_json, self._cpus)
            proc.wait_ready()
        except (GrammarCompilerBusy, EOFError, OSError):
            if proc is not None:
                proc.kill()
            proc = None
        with self._lock:
            self._starting -= 1
            if proc is not None and not self._closed:
                self._ready.append(proc)
                proc = None
            self._changed.notify_all()
        if proc is not None:  # shut down while it started
            proc.kill()

    def _take(self, deadline: float) -> _Process:
        with self._lock:
            self._target = max(self._target, min(self._pool_size, self._busy + 1 + self._spares))
            if not self._ready:
                self.cold_starts += 1
            while not self._ready:
                if self._closed:
                    raise GrammarCompilerBusy("the grammar compiler is shut down")
                self._top_up()  # again after a start that failed
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GrammarCompilerBusy("a grammar compile process did not start")
                self._changed.wait(left)
            proc = self._ready.pop()
            self._busy += 1
            self._top_up()
            return proc

    def _give_back(self, proc: _Process | None) -> None:
        """Return a process after its compile; None when it was killed (a replacement starts now)."""
        with self._lock:
            self._busy -= 1
            if proc is not None and not self._closed:
                self._ready.append(proc)
                proc = None
            self._top_up()
        if proc is not None:
            proc.kill()

    def _answered(self, proc: _Process) -> bool:
        """Wait for the compile's answer: False once it has spent the CPU budget or the wall-clock cap."""
        budget_s = self.timeout_ms / 1000
        wall_end = time.monotonic() + self.wall_cap_ms / 1000
        cpu_start = proc.cpu_seconds()
        while True:
            cpu_left = budget_s - (proc.cpu_seconds() - cpu_start)
            wall_left = wall_end - time.monotonic()
            if cpu_left <= 0 or wall_left <= 0:
                return False
            # The compile is single-threaded (max_threads=1): it cannot spend more CPU time than the
            # wall time that passes, so waiting for the CPU time it has left never overshoots.
            if proc.conn.poll(min(max(cpu_left, _CPU_TICK_S), wall_left)):
                return True

    def _acquire(self, owner: str) -> None:
        turn = threading.Event()
        with self._lock:
            for granted in self._slots.ask(owner, turn):
                granted.set()
        if not turn.wait(self.wait_s):
            with self._lock:
                if self._slots.cancel(turn):
                    raise GrammarCompilerBusy("every grammar compile process is busy")
            # granted as the wait ended: it holds the slot

    def _release(self, owner: str) -> None:
        with self._lock:
            for granted in self._slots.release(owner):
                granted.set()

    def _compile(self, spec: StructuredOutputsParams, owner: str, spent: Callable[[float], None] | None):
        self._acquire(owner)
        try:
            proc = self._take(time.monotonic() + START_TIMEOUT_S)
            start = time.perf_counter()
            try:
                status, payload, seconds = self._run(proc, spec)
            except BaseException:
                self._give_back(None)  # _run killed it
                raise
            finally:
                if spent is not None:
                    spent(time.perf_counter() - start)
            self._give_back(proc)
        finally:
            self._release(owner)
        if status != "ok":
            self.grammars.count_failure()
            raise GrammarError(payload)
        compiled = self.grammars.deserialize(payload)
        self.grammars.store(spec, compiled, seconds)
        return compiled

    def _run(self, proc: _Process, spec: StructuredOutputsParams) -> tuple[str, str, float]:
        """(status, payload, seconds) of one compile in `proc`; on any exception `proc` is killed."""
        start = time.perf_counter()
        try:
            proc.conn.send(spec)
            if self._answered(proc):
                status, payload = proc.conn.recv()
                return status, payload, time.perf_counter() - start
        except (EOFError, OSError):  # the process died under this constraint
            proc.kill()
            self.grammars.count_failure()
            raise GrammarError("the grammar compiler failed on this constraint") from None
        except BaseException:
            proc.kill()
            raise
        proc.kill()
        past_cap = (time.perf_counter() - start) * 1000 >= self.wall_cap_ms
        with self._lock:
            self.timeouts += 1
        self.grammars.count_failure()
        raise GrammarTimeout(self.timeout_ms, self.wall_cap_ms if past_cap else None)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._ready = self._ready, []
            self._changed.notify_all()
        for proc in idle:
            proc.kill()
