"""A client that opens a stream and stops reading blocks nothing: its request runs to its end in the
engine while another tenant's requests are served, and when it reads at last it gets every token (the
front end kept one cumulative output per choice for it, not a backlog), in both engine modes."""
from __future__ import annotations

import json
import socket
import time

import pytest

from tests.fixtures_server import api_redis_url, running_server, server_config

MAX_TOKENS = 400


def _open_unread_stream(port: int, key: str, body: dict) -> socket.socket:
    """Sends the request on a socket with a small receive buffer, and reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + key.encode() + b"\r\nConnection: close\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    chunks = []
    while data := sock.recv(1 << 16):
        chunks.append(data)
    return b"".join(chunks)


def _tokens(raw: bytes) -> tuple[int, str | None]:
    """The stream's tokens (its logprobs entries) and its last finish_reason."""
    count, reason = 0, None
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                count += len((choice.get("logprobs") or {}).get("tokens") or [])
                reason = choice.get("finish_reason") or reason
    return count, reason


@pytest.mark.parametrize("mode", ["in-process", "separate"])
def test_a_client_that_stops_reading_blocks_neither_the_engine_nor_other_streams(mode, tiny_model_dir,
                                                                                   redis_server, tmp_path,
                                                                                   core_starter):
    config = server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server), engine_process=mode)
    with running_server(config, starter=core_starter) as handle:
        _, stalled_key = handle.new_tenant()
        _, other_key = handle.new_tenant()
        model = handle.state.model_id
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "logprobs": 1, "temperature": 0}
        stalled = _open_unread_stream(handle.config.port, stalled_key, body)
        try:
            with handle.http(other_key) as h:
                for i in range(5):
                    with h.stream("POST", "/v1/completions", json={**body, "max_tokens": 20,
                                                                    "prompt": f"p {i}"}) as r:
                        raw = b"".join(r.iter_bytes())
                    assert _tokens(raw) == (20, "length")
            deadline = time.monotonic() + 60
            while handle.state.engine.stats().scheduler.running:  # the unread request ran to its end
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert _tokens(_read_all(stalled)) == (MAX_TOKENS, "length")
        finally:
            stalled.close()
