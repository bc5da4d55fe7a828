"""Real adapter sources on loopback for the tests: an HTTP file server whose routes the test sets
(files, redirects, a body that claims to be huge), which counts the requests it gets, and moto's S3
server (a real S3-compatible HTTP endpoint, threaded, in this process)."""
from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

from benchmarks.loopback_http import LoopbackHTTP
from server.embedded_redis.server import free_port


class FileServer(LoopbackHTTP):
    def __init__(self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self.files: dict[str, bytes] = {}
        self.redirects: dict[str, str] = {}
        self.huge: set[str] = set()        # paths that declare a 10 GiB body and then send little
        self.drip: set[str] = set()        # paths that send one byte every drip_interval s until the client leaves
        self.drip_interval = 0.2
        self.requests: list[str] = []
        self.body_bytes_sent = 0
        super().__init__(self._handler(), host, tls)

    def _handler(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                owner.requests.append(self.path)
                if self.path in owner.redirects:
                    self.send_response(302)
                    self.send_header("Location", owner.redirects[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path in owner.huge:
                    self.send_response(200)
                    self.send_header("Content-Length", str(10 << 30))
                    self.end_headers()
                    with contextlib.suppress(OSError):
                        for _ in range(16):
                            self.wfile.write(b"\0" * 4096)
                            owner.body_bytes_sent += 4096
                    return
                if self.path in owner.drip:
                    self.send_response(200)
                    self.send_header("Content-Length", "1000000")
                    self.end_headers()
                    with contextlib.suppress(OSError):
                        for _ in range(600):
                            self.wfile.write(b"\0")
                            self.wfile.flush()
                            time.sleep(owner.drip_interval)
                    return
                data = owner.files.get(self.path)
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """The endpoint URL of a moto S3 server on loopback."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
