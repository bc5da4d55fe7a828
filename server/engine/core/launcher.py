"""spawn_core: start an engine-core process, its CoreLaunch as msgpack bytes: the process's reserved
core where `serve` forked one (server.engine.core.reserved), else a fork of this process's core fork
server (server.engine.core.fork_server), which imported the core's modules once.

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
from server.engine.core.reserved import RESERVATION


class CoreStarter:
    """This process's way to start cores: the reserved one first, then forks of a fork server, started
    by the first core it forks. A core inherits the fork server's environment and working directory,
    fixed when it started: one fork server per pair seen, so a core still starts in those of the moment
    (as a spawned one did; tests set variables around a server)."""

    def __init__(self) -> None:
        self._fork_servers: dict[tuple[str, frozenset[tuple[str, str]]], CoreForkServer] = {}
        self._lock = threading.Lock()

    def start(self, launch: CoreLaunch) -> CoreHandle:
        raw = msgspec.msgpack.encode(launch)
        reserved = RESERVATION.take()
        if reserved is not None:
            reserved.start(raw)
            return reserved
        key = (os.getcwd(), frozenset(os.environ.items()))
        with self._lock:
            server = self._fork_servers.get(key)
            if server is None:
                server = self._fork_servers[key] = CoreForkServer()
        return server.start(raw)


# Per process by nature, as RESERVATION: its fork server is this process's child.
STARTER = CoreStarter()


def spawn_core(launch: CoreLaunch) -> CoreHandle:
    return STARTER.start(launch)
