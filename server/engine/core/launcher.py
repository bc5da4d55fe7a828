"""CoreStarter: how a process starts engine-core processes, its CoreLaunch as msgpack bytes: the core
`serve` reserved (server.engine.core.reserved) first, then forks of a core fork server
(server.engine.core.fork_server), which imported the core's modules once.

One starter per process that starts cores, passed down from whoever owns that process's life: `serve`
makes it (forking the reserved core before any thread) and hands it to the app, whose engine client
(server.engine.protocol.remote), data-parallel launch or --api-server-count parent starts and restarts
cores with it; an app given none (tests' in-thread servers) makes its own and closes it when it stops.

A process of its own session: a Ctrl-C at the terminal reaches the front end only, which drains and
then tells the core to stop. The core inherits stderr (its log lines) and the environment.
"""
from __future__ import annotations

import os
import threading

import msgspec

from server.engine.core.core_handle import CoreHandle
from server.engine.core.fork_server import CoreForkServer
from server.engine.core.launch import CoreLaunch
from server.engine.core.reserved import ForkedCore

ForkServerKey = tuple[str, frozenset[tuple[str, str]]]  # (working directory, environment)


class CoreStarter:
    """The reserved core first, then forks of a fork server. A core inherits its fork server's environment
    and working directory, fixed when it started, so a core starts in those of the moment (as a spawned
    one did; tests set variables around a server) from the fork server of that pair. The bound: the most
    recent pair's fork server is kept for the next core; any other is closed once none of its cores runs
    (at the next start, or at close), so N environments seen hold one fork server plus those whose cores
    still run."""

    def __init__(self, reserved: ForkedCore | None = None) -> None:
        self._reserved = reserved
        self._fork_servers: dict[ForkServerKey, CoreForkServer] = {}
        self._lock = threading.Lock()

    def start(self, launch: CoreLaunch) -> CoreHandle:
        raw = msgspec.msgpack.encode(launch)
        with self._lock:
            reserved, self._reserved = self._reserved, None
        if reserved is not None:
            reserved.start(raw)
            return reserved
        key = (os.getcwd(), frozenset(os.environ.items()))
        with self._lock:
            server = self._fork_servers.get(key)
            if server is None:
                server = self._fork_servers[key] = CoreForkServer()
            self._close_idle(keep=key)
        return server.start(raw)

    @property
    def fork_servers(self) -> int:
        """Fork servers held (each a process of ~295 MiB)."""
        with self._lock:
            return len(self._fork_servers)

    def close(self) -> None:
        """Release a reserved core never started and end every fork server (its cores stopped by now)."""
        with self._lock:
            reserved, self._reserved = self._reserved, None
            servers, self._fork_servers = list(self._fork_servers.values()), {}
        if reserved is not None:
            reserved.release()
        for server in servers:
            server.close()

    def _close_idle(self, keep: ForkServerKey) -> None:
        for key in [k for k, server in self._fork_servers.items() if k != keep and server.idle()]:
            self._fork_servers.pop(key).close()
