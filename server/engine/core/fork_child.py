"""The body of a forked engine core: `serve`'s reserved one (server.engine.core.reserved) or one of the
core fork server (server.engine.core.fork_server).

Its own module so that the front end can name run_forked_core (multiprocessing pickles the target by
name) without importing the engine: the fork server preloads server.engine.core.process.
"""
from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def exit_after(body: Callable[[], int]) -> NoReturn:
    """Run a forked core's body, then exit with its status (1 where it raised, said on stderr), without
    the interpreter's teardown (as `python -m server.engine.core`: seconds of torch's and the threads')."""
    status = 1
    try:
        status = body()
    except BaseException:  # noqa: BLE001 - said, then the exit status tells the front end
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def run_forked_core(raw_launch: bytes) -> NoReturn:
    """The fork server's child: the core's life from its msgpack CoreLaunch."""
    from server.engine.core.process import core_main  # preloaded: already imported in the fork server

    os.setsid()  # as start_new_session: a signal to the front end's group leaves the core to its drain
    exit_after(lambda: core_main(raw_launch))
