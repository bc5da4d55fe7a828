"""An HTTP server on a loopback port, serving from a daemon thread for the life of a `with` block
(the abuse bench's slow sources, the tests' adapter sources)."""
from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopbackHTTP:
    """`url` (and `port`) once built; serves between __enter__ and __exit__. With `tls`, HTTPS: every
    accepted connection does the server side of a TLS handshake."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1",
                 tls: ssl.SSLContext | None = None) -> None:
        self._httpd = ThreadingHTTPServer((host, 0), handler)
        self._httpd.daemon_threads = True
        if tls is not None:
            self._httpd.socket = tls.wrap_socket(self._httpd.socket, server_side=True)
        self.port = self._httpd.server_address[1]
        self.url = f"{'https' if tls else 'http'}://{host}:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)
