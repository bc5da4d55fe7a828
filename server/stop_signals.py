"""A clean stop on Ctrl-C or SIGTERM: one line, uvicorn's graceful shutdown, exit status 0.

uvicorn handles both signals itself (it stops accepting, gives running requests
timeout_graceful_shutdown seconds, runs the app's shutdown) and then re-raises the
signal it caught so that the previous handler runs: for SIGINT, asyncio's runner
turns it into a KeyboardInterrupt traceback; for SIGTERM, the default action kills
the process. QuietStopServer says one line when a signal arrives and, while it
runs, holds handlers that take the re-raised signal as already dealt with, so
`loraplex serve` returns from main normally once the shutdown is done.
"""
from __future__ import annotations

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


class QuietStopServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            print(f"loraplex: {signal.Signals(sig).name} received: stopping (running requests get "
                  f"{self.config.timeout_graceful_shutdown:g} s; Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
        super().handle_exit(sig, frame)

    def run(self, sockets=None) -> None:
        if threading.current_thread() is not threading.main_thread():
            super().run(sockets=sockets)
            return
        previous = {sig: signal.signal(sig, _already_handled) for sig in STOP_SIGNALS}
        try:
            super().run(sockets=sockets)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
