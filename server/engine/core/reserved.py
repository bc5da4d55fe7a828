"""The reserved engine core: `serve` forks it as soon as it knows it will need one, so a server start
pays for torch and the engine's imports once, not once per process.

A fresh `python -m server.engine.core` imports everything the front end has imported already (torch,
transformers, the engine: seconds of CPU) before it can load the weights, and that came on top of the
front end's start. `reserve_core` imports the engine core's modules in the CLI's process and forks it
there, before any thread exists (no lock can be held by a thread the child lacks; torch has run no
parallel op, so its OpenMP pool starts fresh in the child: vLLM forks its workers on the same
condition). The child waits for its CoreLaunch on a pipe while the CLI goes on (model checks, the
app's imports, Redis), then runs it exactly as a spawned core would (server.engine.core.process).

It is one process, taken by the first spawn_core of this process (server.engine.core.launcher); a
restarted core, or one started where nothing was reserved (tests' in-thread servers, the LLM API),
is spawned as before. A reservation never taken ends when the CLI exits (the pipe's end closes).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from server.engine.core.core_handle import CoreHandle
from server.engine.core.fork_child import exit_after


class ForkedCore(CoreHandle):
    """The reserved core, this process's child."""

    def __init__(self, pid: int, launch_fd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._launch_fd = launch_fd  # the pipe its CoreLaunch is written to (-1 once written or released)
        self._lock = threading.Lock()

    def start(self, raw_launch: bytes) -> None:
        """Hand the waiting child its launch (msgpack CoreLaunch): it builds the engine from here."""
        fd, self._launch_fd = self._launch_fd, -1
        try:
            with os.fdopen(fd, "wb") as pipe:
                pipe.write(raw_launch)
        except BrokenPipeError:
            pass  # the child died while waiting: poll() says so, as for a spawned core that died at start

    def release(self) -> None:
        """Never started: the child reads end-of-file and exits 0."""
        if self._launch_fd >= 0:
            os.close(self._launch_fd)
            self._launch_fd = -1
        self.wait()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode


class Reservation:
    """This process's reserved core until the first spawn_core takes it."""

    def __init__(self) -> None:
        self._core: ForkedCore | None = None
        self._lock = threading.Lock()

    def hold(self, core: ForkedCore) -> None:
        self._core = core

    def take(self) -> ForkedCore | None:
        with self._lock:
            core, self._core = self._core, None
            return core


# Per process by nature (the child is this process's): spawn_core, deep in the engine client, takes it.
RESERVATION = Reservation()


@contextlib.contextmanager
def reserve_core(close: tuple[int, ...] = ()) -> Iterator[None]:
    """Fork the reserved core now (`close`: descriptors the child must not keep, such as the listening
    socket); a no-op where a thread exists already. Call it before this process runs any torch operation
    (an OpenMP pool does not survive a fork). A reservation not taken inside is released."""
    import server.engine.core.process as core_process  # torch and the engine, once, for both processes

    if threading.active_count() > 1:
        yield
        return
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child runs the core and never returns into the CLI
        def body() -> int:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.setsid()  # as a spawned core: a terminal's Ctrl-C reaches the front end only
            os.close(write_fd)
            for fd in close:
                os.close(fd)
            with os.fdopen(read_fd, "rb") as pipe:
                raw = pipe.read()
            return core_process.core_main(raw) if raw else 0

        exit_after(body)
    os.close(read_fd)
    core = ForkedCore(pid, write_fd)
    RESERVATION.hold(core)
    try:
        yield
    finally:
        if RESERVATION.take() is core:
            core.release()
