"""A clean stop on Ctrl-C or SIGTERM: one line, uvicorn's graceful shutdown, exit status 0.

uvicorn handles both signals itself (it stops accepting, gives running requests
timeout_graceful_shutdown seconds, runs the app's shutdown) and then re-raises the
signal it caught so that the previous handler runs: for SIGINT, asyncio's runner
turns it into a KeyboardInterrupt traceback; for SIGTERM, the default action kills
the process. QuietStopServer says one line when a signal arrives and, while it
runs, holds handlers that take the re-raised signal as already dealt with, so
`loraplex serve` returns from main normally once the shutdown is done.

Requests still running when the grace period ends (or at a second Ctrl-C) are cancelled by uvicorn,
which logs each one's CancelledError (and the lifespan's) as a 60-line traceback; while stopping,
StopNoise drops those and the stop ends with one line saying how many were cut.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading

import uvicorn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _already_handled(signum: int, frame) -> None:
    """The signal uvicorn re-raises after its graceful shutdown: the stop is done."""


def quiet_uvicorn_lifecycle() -> None:
    """uvicorn's start and stop chatter ("Started server process", "Waiting for application startup.",
    ...) off: loraplex prints its own line per stage. Its warnings and errors, and the access log, stay."""
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)


class StopNoise(logging.Filter):
    """While `stopping()`: drops the tracebacks of what the stop cancelled (a request's CancelledError or
    KeyboardInterrupt, the lifespan's formatted traceback ending in one), counting the requests."""

    CUT = (asyncio.CancelledError, KeyboardInterrupt)

    def __init__(self, stopping) -> None:
        super().__init__()
        self.stopping = stopping
        self.cut = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.stopping():
            return True
        if record.exc_info and isinstance(record.exc_info[1], self.CUT):
            self.cut += 1
            return False
        text = str(record.msg)
        last = text.rstrip().rsplit("\n", 1)[-1]
        return not (text.startswith("Traceback") and last.startswith(("asyncio.exceptions.CancelledError",
                                                                         "KeyboardInterrupt")))


class QuietStopServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            print(f"loraplex: {signal.Signals(sig).name} received: stopping (running requests get "
                  f"{self.config.timeout_graceful_shutdown:g} s; Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
        super().handle_exit(sig, frame)

    def run(self, sockets=None) -> None:
        noise = StopNoise(lambda: self.should_exit)
        log = logging.getLogger("uvicorn.error")
        log.addFilter(noise)
        main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, _already_handled) for sig in STOP_SIGNALS} if main else {}
        try:
            super().run(sockets=sockets)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            log.removeFilter(noise)
        if noise.cut:
            print(f"loraplex: {noise.cut} running request(s) cut at the stop (past --shutdown-timeout "
                  f"{self.config.timeout_graceful_shutdown:g} s, or a second Ctrl-C)", file=sys.stderr, flush=True)
