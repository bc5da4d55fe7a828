"""Admin API and quotas: each limit trips with the right status and recovers; two
app processes on one Redis enforce one shared limit."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from starlette.requests import Request

from server.api.errors import APIError
from server.api.upload import read_adapter_upload

from tests.fixtures_server import ADMIN_TOKEN, api_redis_url
from server.embedded_redis.server import free_port
from tests.repo import ROOT_DIR


def _complete(server, key, **kw) -> httpx.Response:
    body = {"model": server.state.model_id, "prompt": "hello", "max_tokens": 4, **kw}
    with server.http(key) as h:
        return h.post("/v1/completions", json=body)


def test_admin_crud_and_auth(api_server):
    name, key = api_server.new_tenant({"requests_per_minute": 5})
    t = api_server.admin("GET", f"/admin/tenants/{name}").json()
    assert t["quota"]["requests_per_minute"] == 5 and len(t["keys"]) == 1
    r = api_server.admin("PATCH", f"/admin/tenants/{name}", json={"quota": {"max_adapters": 2}})
    assert r.status_code == 200 and r.json()["quota"]["max_adapters"] == 2
    assert r.json()["quota"]["requests_per_minute"] == 5
    assert api_server.admin("PATCH", f"/admin/tenants/{name}", json={"quota": {"bogus": 1}}).status_code == 400
    assert api_server.admin("PATCH", f"/admin/tenants/{name}",
                            json={"quota": {"max_adapters": -1}}).status_code == 400
    assert api_server.admin("POST", "/admin/tenants", json={"name": name}).status_code == 409
    assert api_server.admin("POST", "/admin/tenants", json={"name": "Bad Name!"}).status_code == 400
    assert api_server.admin("GET", "/admin/tenants/nobody").status_code == 404
    assert name in [t["name"] for t in api_server.admin("GET", "/admin/tenants").json()["data"]]
    # a tenant key on /admin is refused, as are no token and a wrong one
    with api_server.http(key) as h:
        assert h.get("/admin/tenants").status_code == 403
    with api_server.http() as h:
        assert h.get("/admin/tenants").status_code == 401
    with api_server.http("not-the-admin-token-at-all") as h:
        assert h.post("/admin/tenants", json={"name": "x"}).status_code == 401
    # revoking a key, then deleting the tenant, locks it out
    key_id = t["keys"][0]["id"]
    second = api_server.admin("POST", f"/admin/tenants/{name}/keys").json()["key"]
    assert api_server.admin("DELETE", f"/admin/tenants/{name}/keys/{key_id}").status_code == 200
    assert _complete(api_server, key).status_code == 401
    assert _complete(api_server, second).status_code == 200
    assert api_server.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
    assert _complete(api_server, second).status_code == 401


def _wait_window(server) -> None:
    time.sleep(server.config.rate_window_seconds + 0.2)


def test_requests_per_minute_trips_and_recovers(api_server):
    _, key = api_server.new_tenant({"requests_per_minute": 2})
    assert [_complete(api_server, key).status_code for _ in range(2)] == [200, 200]
    r = _complete(api_server, key)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "requests_per_minute"
    _wait_window(api_server)
    assert _complete(api_server, key).status_code == 200


def test_tokens_per_minute_and_per_request(api_server):
    name, key = api_server.new_tenant({"tokens_per_minute": 30, "max_tokens_per_request": 20})
    prompt_len = len(api_server.tokenizer("hello").input_ids)
    assert prompt_len + 16 <= 30 < 2 * (prompt_len + 16)
    assert _complete(api_server, key, max_tokens=21).status_code == 400  # can never pass
    assert _complete(api_server, key, max_tokens=16, ignore_eos=True).status_code == 200
    r = _complete(api_server, key, max_tokens=16)
    assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_per_minute"
    with api_server.http(key) as h:
        usage = h.get("/v1/usage").json()
    assert usage["total"]["requests"] == 1 and usage["total"]["completion_tokens"] == 16
    assert usage["limits"]["tokens_per_minute"] == 30
    _wait_window(api_server)
    assert _complete(api_server, key, max_tokens=16).status_code == 200
    assert _complete(api_server, key, max_tokens=40).status_code == 400  # above the tpm itself


def test_concurrency_limit_trips_and_recovers(api_server):
    name, key = api_server.new_tenant({"max_concurrent_requests": 1})
    results = []
    with api_server.engine_paused():
        # Admitted, then held at the paused engine: it occupies the tenant's one slot.
        first = threading.Thread(target=lambda: results.append(_complete(api_server, key, max_tokens=8)))
        first.start()
        deadline = time.monotonic() + 10
        while api_server.state.limiter.current(api_server.state.tenants.get(name))["concurrent_requests"] == 0:
            assert time.monotonic() < deadline, "the first request was never admitted"
            time.sleep(0.02)
        r = _complete(api_server, key)
        assert r.status_code == 429 and r.json()["error"]["code"] == "max_concurrent_requests"
        assert int(r.headers["Retry-After"]) >= 1
    first.join(30)
    assert results[0].status_code == 200
    # the first request's end freed its slot
    assert api_server.state.limiter.current(api_server.state.tenants.get(name))["concurrent_requests"] == 0
    assert _complete(api_server, key).status_code == 200


def test_adapter_count_and_bytes_limits(api_server, tiny_adapters):
    r8 = tiny_adapters["r8_all"]
    name, key = api_server.new_tenant({"max_adapters": 1, "max_adapter_bytes": 20_000})
    small = api_server.upload(key, "small", tiny_adapters["r4_qv"])
    assert small.status_code == 201 and small.json()["size_bytes"] <= 20_000
    big = api_server.upload(key, "big", r8)
    assert big.status_code == 413 and big.json()["error"]["code"] == "max_adapter_bytes"
    api_server.admin("PATCH", f"/admin/tenants/{name}", json={"quota": {"max_adapter_bytes": None}})
    r = api_server.upload(key, "big", r8)
    # not transient: a 403 with no Retry-After (waiting never helps)
    assert r.status_code == 403 and r.json()["error"]["code"] == "max_adapters" and "Retry-After" not in r.headers
    assert api_server.upload(key, "small", r8, replace=True).status_code == 201  # a replace is not a new one
    with api_server.http(key) as h:
        assert h.delete("/v1/adapters/small").status_code == 200
    assert api_server.upload(key, "big", r8).status_code == 201


def test_body_cap_is_enforced_before_reading_it_all(api_server):
    _, key = api_server.new_tenant({"max_adapter_bytes": 1000})
    cap = 1000 + 1024 * 1024 + 64 * 1024

    def body():
        # Streamed without a Content-Length: the server must stop us mid-way.
        yield (b'--zzz\r\nContent-Disposition: form-data; name="adapter_model.safetensors"; '
               b'filename="adapter_model.safetensors"\r\n\r\n')
        chunk = b"x" * 65536
        for _ in range(cap // 65536 + 64):
            yield chunk
    with api_server.http(key) as h:
        r = h.post("/v1/adapters", content=body(),
                   headers={"Content-Type": "multipart/form-data; boundary=zzz"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with api_server.http(key) as h:  # and with a Content-Length above the cap: refused up front
        r = h.post("/v1/adapters", content=b"x" * (cap + 1),
                   headers={"Content-Type": "multipart/form-data; boundary=zzz"})
    assert r.status_code == 413


def _spawn(model_dir, redis_url, port, data_dir):
    env = {**os.environ, "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir), "--redis-url", redis_url,
           "--port", str(port), "--device", "cpu", "--kv-cache-blocks", "64", "--max-model-len", "256",
           "--data-dir", str(data_dir)]
    return subprocess.Popen(cmd, env=env, cwd=str(ROOT_DIR),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _wait_up(url, proc, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server process exited"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not come up")


def test_two_processes_share_one_limit(tiny_model_dir, redis_server, tmp_path):
    url = api_redis_url(redis_server)
    ports = [free_port(), free_port()]
    procs = [_spawn(tiny_model_dir, url, p, tmp_path / str(p)) for p in ports]
    try:
        bases = [f"http://127.0.0.1:{p}" for p in ports]
        for b, p in zip(bases, procs):
            _wait_up(b, p)
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert httpx.post(f"{bases[0]}/admin/tenants", headers=admin,
                          json={"name": "shared", "quota": {"requests_per_minute": 3}}).status_code == 201
        key = httpx.post(f"{bases[1]}/admin/tenants/shared/keys", headers=admin).json()["key"]
        model = tiny_model_dir.name
        codes = [httpx.post(f"{bases[i % 2]}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                            json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=30).status_code
                 for i in range(5)]
        assert codes == [200, 200, 200, 429, 429]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def test_upload_reader_stops_pulling_the_body_at_the_cap():
    # At the ASGI level: how many body chunks the reader pulls before refusing.
    pulled = []
    head = (b'--zzz\r\nContent-Disposition: form-data; name="adapter_model.safetensors"; '
            b'filename="adapter_model.safetensors"\r\n\r\n')

    async def receive():
        pulled.append(1)
        return {"type": "http.request", "body": head if len(pulled) == 1 else b"x" * 1000, "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/v1/adapters", "query_string": b"",
             "headers": [(b"content-type", b"multipart/form-data; boundary=zzz")]}
    with pytest.raises(APIError) as info:
        asyncio.run(read_adapter_upload(Request(scope, receive), cap=10_000))
    assert info.value.status == 413
    assert len(pulled) <= 12  # ~10 KB of 1 KB chunks, never the endless rest
