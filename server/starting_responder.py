"""StartingResponder: `serve`'s answer while the server starts: 503 to every request, /health included.

The CLI binds the port first (a port in use is one line at once), but uvicorn accepts connections only
once the app's lifespan has built everything (Redis, the weights, the engine core ready). Until then a
connection waited in the listen backlog: a health check hung (or timed out) instead of hearing 503,
and an orchestrator could not tell a starting server from a stuck one. This thread answers on the same
listening socket until the app is ready, then stops (joined) before uvicorn serves: one acceptor at a
time, nothing lost (a connection that arrives between the two waits in the backlog for uvicorn).

Each answer is `Connection: close` after reading at most the request's head (bounded in bytes and time,
so a client that sends nothing holds this thread for READ_TIMEOUT_S or so); a body is read and dropped.
"""
from __future__ import annotations

import contextlib
import json
import select
import socket
import threading

POLL_S = 0.1
READ_TIMEOUT_S = 1.0
MAX_HEAD_BYTES = 16 << 10
MAX_DRAIN_BYTES = 1 << 20  # of a request's body, read and dropped after the answer
RETRY_AFTER_S = 1  # as the app's engine_unavailable answers

BODY = json.dumps({
    "status": "starting", "engine": False, "engine_error": "the server is starting: the engine is not ready yet",
    "error": {"message": "the server is starting: the engine is not ready yet", "type": "server_error",
              "code": "engine_unavailable"},
}).encode()
RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: %d\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (RETRY_AFTER_S, len(BODY))) + BODY


class StartingResponder:
    """503 on `sock` from start() until stop()."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="starting-responder", daemon=True)
        self.answered = 0

    def start(self) -> "StartingResponder":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Returns once this thread accepts no more: the socket is uvicorn's from here. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not select.select([self._sock], [], [], POLL_S)[0] or self._stop.is_set():
                continue
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(READ_TIMEOUT_S)
        head = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in head and len(head) < MAX_HEAD_BYTES:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                head += chunk
            conn.sendall(RESPONSE)
            conn.shutdown(socket.SHUT_WR)
            self.answered += 1
            # Drained (bounded) before the close: unread bytes would make it a reset, which can reach the
            # client before the response does.
            drained = 0
            while drained < MAX_DRAIN_BYTES and (chunk := conn.recv(65536)):
                drained += len(chunk)
