"""spawn_core: start an engine-core process (`python -m server.engine.core`), its CoreLaunch on stdin;
the process's reserved core instead where `serve` forked one (server.engine.core.reserved).

A process of its own session: a Ctrl-C at the terminal reaches the front end only, which drains and
then tells the core to stop. The core inherits stderr (its log lines) and the environment.
"""
from __future__ import annotations

import subprocess
import sys

import msgspec

from server.engine.core.launch import CoreLaunch
from server.engine.core.reserved import RESERVATION, ForkedCore


def spawn_core(launch: CoreLaunch) -> subprocess.Popen | ForkedCore:
    reserved = RESERVATION.take()
    if reserved is not None:
        reserved.start(msgspec.msgpack.encode(launch))
        return reserved
    proc = subprocess.Popen([sys.executable, "-m", "server.engine.core"], stdin=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdin is not None
    try:
        proc.stdin.write(msgspec.msgpack.encode(launch))
    finally:
        proc.stdin.close()
    return proc
