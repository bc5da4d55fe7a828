"""Grammar compilation under a hard deadline, in child processes.

xgrammar cannot be interrupted once it compiles (a 20,000-value enum took 275 s on the
2-core dev machine), so a compile that passes its deadline is ended the only sure way:
its process is killed, and a fresh one takes its place. The result comes back
serialised and is bound to the engine's tokenizer in this process (Grammars.deserialize).
Callers block (run `compile` off the event loop and off the engine thread); at most
`processes` compiles run at once, the rest wait for a free process.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from multiprocessing.connection import Connection

from server.engine.grammar import GrammarError, Grammars, compile_constraint
from server.engine.structured_outputs import StructuredOutputsParams

START_TIMEOUT_S = 180.0  # a process imports xgrammar (and torch) before its first compile
# Compile processes run at a lower CPU priority than the engine: on a machine with few cores, a
# flood of slow schemas (and the imports of each replacement for a killed process) then takes
# the cycles the engine leaves, not the ones other tenants' decode steps need.
COMPILE_NICENESS = 10


class GrammarTimeout(GrammarError):
    """The constraint did not compile within the deadline (its compile was killed)."""

    def __init__(self, limit_ms: int) -> None:
        super().__init__(f"the constraint did not compile within {limit_ms} ms")
        self.limit_ms = limit_ms


class GrammarCompilerBusy(RuntimeError):
    """Every compile process stayed busy for as long as a request may wait for one."""


def _serve(conn: Connection, tokenizer_info_json: str) -> None:
    """The child's loop: a StructuredOutputsParams in, ("ok", serialised grammar) or ("error", why) out."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", compile_constraint(compiler, spec).serialize_json()))
        except GrammarError as e:
            conn.send(("error", str(e)))


class _Process:
    def __init__(self, ctx, tokenizer_info_json: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, tokenizer_info_json), daemon=True,
                                name="loraplex-grammar-compiler")
        self.proc.start()
        try:  # at once, so the child's imports already run at the lower priority
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, COMPILE_NICENESS)
        except OSError:  # the child is gone already: its first message says so
            pass
        child.close()
        self.ready = False

    def wait_ready(self) -> None:
        if not self.ready:
            if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv() != "ready":
                raise GrammarCompilerBusy("a grammar compile process did not start")
            self.ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class GrammarCompileService:
    """Compiles for `grammars` (the engine's cache) in up to `processes` child processes, each
    compile killed after `timeout_ms`. Started lazily: a server that never sees a constraint
    never starts one."""

    def __init__(self, grammars: Grammars, timeout_ms: int, processes: int = 2,
                 wait_s: float | None = None) -> None:
        assert timeout_ms > 0 and processes > 0
        self.grammars = grammars
        self.timeout_ms = timeout_ms
        # A waiting request gives up after this long (others' compiles end by their deadline).
        self.wait_s = wait_s if wait_s is not None else START_TIMEOUT_S + 4 * timeout_ms / 1000
        self._info_json = grammars.info.serialize_json()
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process with threads
        self._slots = threading.BoundedSemaphore(processes)
        self._idle: list[_Process] = []
        self._lock = threading.Lock()
        self.timeouts = 0
        self._running = 0  # compiles asked for and not yet answered (waiting for a process, or compiling)
        self._closed = False

    @property
    def running(self) -> int:
        with self._lock:
            return self._running

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar (from the cache when it can); GrammarError / GrammarTimeout say why not."""
        cached = self.grammars.lookup(spec)
        if cached is not None:
            return cached
        with self._lock:
            self._running += 1
        try:
            return self._compile(spec)
        finally:
            with self._lock:
                self._running -= 1

    def _compile(self, spec: StructuredOutputsParams):
        if not self._slots.acquire(timeout=self.wait_s):
            raise GrammarCompilerBusy("every grammar compile process is busy")
        proc = None
        try:
            with self._lock:
                if self._closed:
                    raise GrammarCompilerBusy("the grammar compiler is shut down")
                proc = self._idle.pop() if self._idle else _Process(self._ctx, self._info_json)
            proc.wait_ready()
            start = time.perf_counter()
            proc.conn.send(spec)
            if not proc.conn.poll(self.timeout_ms / 1000):
                proc.kill()
                proc = None
                with self._lock:
                    self.timeouts += 1
                self.grammars.count_failure()
                raise GrammarTimeout(self.timeout_ms)
            status, payload = proc.conn.recv()
            seconds = time.perf_counter() - start
        except (EOFError, OSError):  # the process died under this constraint
            if proc is not None:
                proc.kill()
                proc = None
            self.grammars.count_failure()
            raise GrammarError("the grammar compiler failed on this constraint") from None
        except GrammarCompilerBusy:  # it never started: a fresh one gets the next try
            if proc is not None:
                proc.kill()
                proc = None
            raise
        finally:
            if proc is not None:
                with self._lock:
                    if self._closed:
                        proc.kill()
                    else:
                        self._idle.append(proc)
            self._slots.release()
        if status != "ok":
            self.grammars.count_failure()
            raise GrammarError(payload)
        compiled = self.grammars.deserialize(payload)
        self.grammars.store(spec, compiled, seconds)
        return compiled

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for proc in idle:
            proc.kill()
