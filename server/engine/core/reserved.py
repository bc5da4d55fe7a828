"""The reserved engine core: `serve` forks it as soon as it knows it will need one, so a server start
pays for torch and the engine's imports once, not once per process.

A fresh `python -m server.engine.core` imports everything the front end has imported already (torch,
transformers, the engine: seconds of CPU) before it can load the weights, and that came on top of the
front end's start. `reserve_core` imports the engine core's modules in the CLI's process and forks it
there, before any thread exists (no lock can be held by a thread the child lacks; torch has run no
parallel op, so its OpenMP pool starts fresh in the child: vLLM forks its workers on the same
condition). The child waits for its CoreLaunch on a pipe while the CLI goes on (model checks, the
app's imports, Redis), then runs it exactly as a spawned core would (server.engine.core.process).

It is one process, handed to the CoreStarter that `serve` passes down (server.engine.core.launcher),
whose first core it becomes; a restarted core, or one started where nothing was reserved (tests'
in-thread servers), is a fork server's. A reservation never taken is released when the starter closes
(and ends anyway when the CLI exits: the pipe's end closes).
"""
from __future__ import annotations

import os
import signal
import threading

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


def reserve_core(close: tuple[int, ...] = ()) -> ForkedCore | None:
    """Fork the reserved core now (`close`: descriptors the child must not keep, such as the listening
    socket); None where a thread exists already. Call it before this process runs any torch operation
    (an OpenMP pool does not survive a fork). Whoever holds it starts or releases it."""
    import server.engine.core.process as core_process  # torch and the engine, once, for both processes

    if threading.active_count() > 1:
        return None
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
    return ForkedCore(pid, write_fd)
