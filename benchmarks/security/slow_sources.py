"""Hostile adapter sources on loopback for the abuse bench's slow_source attack (issue 43): an HTTP
server whose every file under /slow/ trickles out at a few hundred bytes a second and under /drip/
one byte every `drip_s` seconds (set just inside the server's read timeout, so that only a total
fetch deadline ends it). Both declare a 1 MB body and never finish within any fetch timeout."""
from __future__ import annotations

import contextlib
import time
from http.server import BaseHTTPRequestHandler

from benchmarks.loopback_http import LoopbackHTTP

SLOW, DRIP = "slow", "drip"
DECLARED_BYTES = 1_000_000
SLOW_CHUNK, SLOW_INTERVAL_S = 64, 0.25  # 256 bytes a second
MAX_SEND_S = 600.0  # a client that never leaves still frees the handler thread


class SlowSource(LoopbackHTTP):
    """`with SlowSource(drip_s) as src:` serves src.url + "/slow/..." and src.url + "/drip/..."."""

    def __init__(self, drip_s: float, host: str = "127.0.0.1") -> None:
        super().__init__(_handler(drip_s), host)


def _handler(drip_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            kind = self.path.strip("/").split("/", 1)[0]
            if kind not in (SLOW, DRIP):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            chunk, interval = (SLOW_CHUNK, SLOW_INTERVAL_S) if kind == SLOW else (1, drip_s)
            self.send_response(200)
            self.send_header("Content-Length", str(DECLARED_BYTES))
            self.end_headers()
            deadline = time.monotonic() + MAX_SEND_S
            with contextlib.suppress(OSError):  # the fetch gave up: the loader closed the connection
                while time.monotonic() < deadline:
                    self.wfile.write(b"\0" * chunk)
                    self.wfile.flush()
                    time.sleep(interval)

    return Handler
