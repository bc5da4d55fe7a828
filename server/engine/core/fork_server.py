"""CoreForkServer: engine cores forked from a fork server that imported the core's modules once.

A spawned core (`python -m server.engine.core`) imports torch, transformers and the engine before it
can load the weights: seconds of CPU for every restarted core, every data-parallel core, every core
of a server started inside another process (tests, the LLM API). This process instead starts one
multiprocessing fork server (its own, not the module-wide one that grammar compiles share and nice:
server.engine.grammar_worker), which preloads server.engine.core.process; each core is then a fork of
it. The fork server is single-threaded and has only imported (no torch parallel op has run, so the
child's OpenMP pool starts fresh); the child pins itself before starting a thread (run_core).

The launch reaches the child as its msgpack bytes, the target's only argument; the child's
preparation carries no main module (a user's script is not imported again in the core). The core
is not one of multiprocessing's children (its exit handler would join it): ForkServedCore is the
handle, as much of subprocess.Popen as the engine clients use, its exit status from the fork server.

A fork server is ~295 MiB of imports: close() ends one that no core needs any more (its owner, the
CoreStarter, keeps few: server.engine.core.launcher). multiprocessing gives every child the fork
server's "alive" pipe, so the fork server outlives our end of it while one of its cores runs: close
waits for it (it has reaped every core by then: each one's status was read), killing it past a bound.
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import select
import signal
import threading
import time
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from multiprocessing.context import set_spawning_popen

from server.engine.core.core_handle import CoreHandle
from server.engine.core.fork_child import run_forked_core

PRELOAD = ["server.engine.core.process", "server.engine.core.fork_child"]
# The fork server writes a child's status once it has reaped it: how long to wait for that after the
# child's pidfd said it exited (the fork server itself may be gone: killed with the front end's group).
STATUS_WAIT_S = 2.0
CLOSE_WAIT_S = 5.0  # the fork server's exit after its alive pipe closed (it only tidies up)
LOST_STATUS = 255  # as multiprocessing's, where the fork server died before telling


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, bound to our fork server, with no main module to re-import."""

    def __init__(self, process_obj, server: forkserver.ForkServer) -> None:
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        for key in ("init_main_from_path", "init_main_from_name", "start_method"):
            prep_data.pop(key, None)
        buf = io.BytesIO()
        set_spawning_popen(self)  # multiprocessing pickles the Process's authkey only while spawning
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = self._server.connect_to_new_process(self._fds)
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class ForkServedCore(CoreHandle):
    """A core forked by the fork server: its exit status comes from the fork server, which reaps it."""

    def __init__(self, popen: _Popen) -> None:
        self.pid = popen.pid
        self.returncode: int | None = None
        self._sentinel = popen.sentinel  # the fork server writes the exit status here
        # Readable once the core exits, even if the fork server is gone. None where the core is gone
        # already, or the kernel has no pidfd (before Linux 5.3): then the status alone says it exited.
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(self.pid)
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None and select.select([self._sentinel if self._pidfd is None else self._pidfd], [], [], 0)[0]:
                self.returncode = self._status()
                if self._pidfd is not None:
                    os.close(self._pidfd)
                os.close(self._sentinel)
            return self.returncode

    def _status(self) -> int:
        if not select.select([self._sentinel], [], [], STATUS_WAIT_S)[0]:
            return LOST_STATUS
        try:
            return forkserver.read_signed(self._sentinel)
        except (OSError, EOFError):
            return LOST_STATUS


class CoreForkServer:
    """A fork server for engine cores, started by the first core asked for, ended by close()."""

    def __init__(self) -> None:
        self._server = forkserver.ForkServer()
        self._server.set_forkserver_preload(PRELOAD)
        self._cores: list[ForkServedCore] = []
        self._lock = threading.Lock()  # data-parallel cores start from several threads at once

    def start(self, raw_launch: bytes) -> ForkServedCore:
        process = multiprocessing.get_context("forkserver").Process(
            target=run_forked_core, args=(raw_launch,), name="loraplex-core")
        core = ForkServedCore(_Popen(process, self._server))
        with self._lock:
            self._cores = [c for c in self._cores if c.poll() is None] + [core]
        return core

    @property
    def pid(self) -> int | None:
        """The fork server's process (None before its first core, or once closed)."""
        return self._server._forkserver_pid

    def idle(self) -> bool:
        """No core of its runs (each one's exit status read: the fork server has reaped it)."""
        with self._lock:
            self._cores = [c for c in self._cores if c.poll() is None]
            return not self._cores

    def close(self) -> None:
        """End the fork server and reap it: its alive pipe closed (it exits once no core of its holds the
        other end), killed past CLOSE_WAIT_S (a core left running then outlives it, reparented)."""
        pid, alive_fd = self._server._forkserver_pid, self._server._forkserver_alive_fd
        if pid is None:
            return
        self._server._forkserver_pid = self._server._forkserver_alive_fd = None
        os.close(alive_fd)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        address, self._server._forkserver_address = self._server._forkserver_address, None
        if not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)
