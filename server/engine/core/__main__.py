"""`python -m server.engine.core`: an engine-core process, its CoreLaunch read from stdin (msgpack)."""
from __future__ import annotations

import os
import sys

from server.engine.core.process import core_main

if __name__ == "__main__":
    status = core_main(sys.stdin.buffer.read())
    # run_core has sent every message and closed the engine, Redis and the loaders: skip the
    # interpreter's finalisation, which took ~3 s (torch's and the engine threads' teardown) of every
    # server's stop and restart.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
