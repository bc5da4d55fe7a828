"""StartingResponder (server.starting_responder) on a real listening socket: 503 with Retry-After to a
GET and to a POST with a body, a client that sends nothing does not stop the next one being answered,
and after stop() a new connection waits in the backlog for the socket's next owner (nothing lost).
End to end with `loraplex serve`: tests/server/test_health_while_starting.py."""
from __future__ import annotations

import socket

import httpx
import pytest

from server.cli import bind_listener
from server.starting_responder import StartingResponder

pytestmark = pytest.mark.unit


def test_answers_503_until_stopped_then_leaves_connections_to_the_next_owner():
    with bind_listener("127.0.0.1", 0) as sock:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        responder = StartingResponder(sock).start()
        try:
            silent = socket.create_connection(sock.getsockname()[:2])  # holds the responder a moment, no more
            health = httpx.get(f"{url}/health", timeout=30)
            assert health.status_code == 503 and health.headers["retry-after"] == "1"
            assert health.json()["status"] == "starting" and health.json()["engine"] is False
            posted = httpx.post(f"{url}/v1/completions", content=b"x" * (256 << 10), timeout=30)
            assert posted.status_code == 503 and posted.json()["error"]["code"] == "engine_unavailable"
            silent.close()
        finally:
            responder.stop()
        assert responder.answered >= 2
        late = socket.create_connection(sock.getsockname()[:2])
        try:
            sock.settimeout(10)
            conn, _ = sock.accept()  # still queued: the responder accepts nothing once stopped
            conn.close()
        finally:
            late.close()
