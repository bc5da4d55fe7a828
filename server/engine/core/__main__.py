"""`python -m server.engine.core`: an engine-core process, its CoreLaunch read from stdin (msgpack)."""
from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec

from server.engine.core.launch import CoreLaunch
from server.engine.core.process import run_core


def main() -> int:
    # The front end owns the core's lifecycle: on SIGINT/SIGTERM it drains its requests, then sends
    # shutdown. A supervisor that signals every process of the group (systemd's control-group kill)
    # must not end the core under requests still draining; it exits anyway once its front end is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    launch = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=CoreLaunch)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("loraplex engine core: %(message)s"))
    root = logging.getLogger("server")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return run_core(launch, os.getpid())


if __name__ == "__main__":
    status = main()
    # run_core has sent every message and closed the engine, Redis and the loaders: skip the
    # interpreter's finalisation, which took ~3 s (torch's and the engine threads' teardown) of every
    # server's stop and restart.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
