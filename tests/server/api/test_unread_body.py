"""Early refusals of large bodies on a real uvicorn server: answered before the body is all sent, the
connection closed instead of the rest received (server.api.unread_body), the status and message the
same as a refusal after the whole body; normal requests keep their connection."""
from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.fixtures_server import ServerHandle, api_redis_url, running_server, server_config

IDS_CHUNK = b"1234," * 13_107  # 64 KiB of token ids


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, core_starter) -> Iterator[ServerHandle]:
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("unread-body-data"), api_redis_url(redis_server),
                           rate_window_seconds=60.0)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _head(server: ServerHandle, path: str, declared: int, key: str | None) -> bytes:
    host = server.url.removeprefix("http://").split(":")[0]
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n").encode()


def _response(s: socket.socket) -> tuple[int, dict[str, str], dict]:
    """The status, headers and JSON body of the one response on `s`."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed before a response: {raw!r}"
        raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (ln.partition(":") for ln in lines[1:])}
    while len(payload) < int(headers["content-length"]):
        chunk = s.recv(65536)
        assert chunk, "the connection closed inside the response"
        payload += chunk
    return int(lines[0].split()[1]), headers, json.loads(payload)


def _closed_by_server(s: socket.socket) -> bool:
    """The server ended the connection (its FIN, or a reset for the body bytes it never read)."""
    try:
        return s.recv(65536) == b""
    except ConnectionResetError:
        return True


def _send_part(server: ServerHandle, path: str, declared: int, first: bytes, key: str | None,
               ) -> tuple[int, dict[str, str], dict, bool]:
    """Declare a `declared`-byte body, send only `first` of it, then read the answer: a server that waits
    for the whole body never answers (the socket's timeout fails the test)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(_head(server, path, declared, key) + first)
        status, headers, body = _response(s)
        return status, headers, body, _closed_by_server(s)


def _ids_body(server: ServerHandle, count: int) -> bytes:
    return ('{"model":"%s","prompt":[%s],"max_tokens":1}'
            % (server.state.model_id, ",".join(["1234"] * count))).encode()


def test_too_many_token_ids_is_refused_before_the_rest_of_the_body_arrives(server):
    _, key = server.new_tenant()
    # The bound: a full batch of context-length prompts plus the other fields' values.
    cap = server.config.max_batch_prompts * server.state.engine.info.max_model_len + (1 << 16)
    declared = 15 << 20
    first = b'{"model":"%s","prompt":[' % server.state.model_id.encode() + IDS_CHUNK * (cap * 5 // len(IDS_CHUNK) + 2)
    assert len(first) < declared // 4
    status, headers, body, closed = _send_part(server, "/v1/completions", declared, first, key)
    # the same answer as once the whole body is read (test_api_abuse's 15 MB body through httpx)
    assert status == 400 and body["error"]["code"] == "too_many_values", body
    assert f"more than {cap} values" in body["error"]["message"]
    assert headers.get("connection") == "close" and closed


def test_the_whole_huge_body_through_httpx_gets_the_same_400(server):
    """httpx reads the answer after the server stops reading (its write fails): the client still
    learns why, and its upload ends early."""
    _, key = server.new_tenant()
    body = _ids_body(server, 3_000_000)
    sent = 0

    def upload() -> Iterator[bytes]:
        nonlocal sent
        for lo in range(0, len(body), 1 << 16):
            sent += len(body[lo:lo + (1 << 16)])
            yield body[lo:lo + (1 << 16)]

    with server.http(key) as h:
        r = h.post("/v1/completions", content=upload(),
                   headers={"Content-Type": "application/json", "Content-Length": str(len(body))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_values", r.text
    assert r.headers["connection"] == "close"
    assert sent < len(body), "the client sent its whole body: the server received it all"


@pytest.mark.parametrize("case", ["no_key", "over_quota", "content_length_over_cap"])
def test_a_refusal_before_the_body_closes_the_connection_unread(server, case):
    model = server.state.model_id
    key = None
    if case == "over_quota":
        _, key = server.new_tenant({"requests_per_minute": 1})
        with server.http(key) as h:
            assert h.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1}).status_code == 200
    elif case == "content_length_over_cap":
        _, key = server.new_tenant()
    declared = server.config.max_request_bytes + 1 if case == "content_length_over_cap" else 8 << 20
    status, headers, body, closed = _send_part(server, "/v1/completions", declared, b'{"model":"x","prompt":[1,',
                                               key)
    expected = {"no_key": 401, "over_quota": 429, "content_length_over_cap": 413}[case]
    assert status == expected, body
    if case == "over_quota":
        assert body["error"]["code"] == "requests_per_minute"
    if case == "content_length_over_cap":
        assert "--max-request-bytes" in body["error"]["message"]
    assert headers.get("connection") == "close" and closed


def test_read_bodies_and_small_refused_ones_keep_the_connection(server):
    _, key = server.new_tenant()
    model = server.state.model_id
    limit = server.state.engine.info.max_model_len
    # a large body read whole (a batch of 64 KiB+) and a small refused one: neither closes
    large = {"model": model, "prompt": [[7] * (limit - 1)] * 48, "max_tokens": 1}
    assert len(json.dumps(large)) > 64 << 10
    ports = set()

    def local_port(r: httpx.Response) -> None:
        ports.add(r.extensions["network_stream"].get_extra_info("socket").getsockname()[1])

    with server.http(key) as h:
        r = h.post("/v1/completions", json=large, extensions={"trace": None})
        assert r.status_code == 200, r.text
        assert "connection" not in r.headers
        local_port(r)
        r = h.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1, "bogus": 1})
        assert r.status_code == 400 and "connection" not in r.headers
        local_port(r)
        r = h.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200
        local_port(r)
    assert len(ports) == 1, "a request that kept its connection was answered on a new one"
