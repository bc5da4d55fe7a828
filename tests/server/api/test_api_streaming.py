"""Client disconnects: a request whose client goes away is aborted and its KV
blocks are freed, mid-stream or before its first token."""
from __future__ import annotations

import threading
import time

import httpx



def _wait_for(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _aborted(server, tenant: str) -> float:
    sample = server.state.metrics.registry.get_sample_value(
        "loraplex_requests_total", {"tenant": tenant, "endpoint": "completions", "outcome": "aborted"})
    return sample or 0.0


def test_disconnect_mid_stream_aborts_and_frees_kv(api_server):
    tenant, key = api_server.new_tenant()
    prompt = [7] * 100  # a few KV blocks' worth of prompt
    body = {"model": api_server.state.model_id, "prompt": prompt, "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with api_server.engine_throttled():
        with httpx.Client(base_url=api_server.url, headers={"Authorization": f"Bearer {key}"}) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                stats = api_server.state.engine.stats()
                assert stats.scheduler.running == 1 and stats.kv_blocks.used >= 100 // 16
        # the connection is closed: the server must abort the request
        _wait_for(lambda: _aborted(api_server, tenant) == 1)
        _wait_for(lambda: api_server.state.engine.stats().kv_blocks.used == 0)
        assert api_server.state.engine.stats().scheduler.running == 0
    with api_server.http(key) as h:
        usage = h.get("/v1/usage").json()
    assert 1 <= usage["total"]["completion_tokens"] < 400  # charged for what it got
    assert usage["current"]["concurrent_requests"] == 0


def test_disconnect_before_first_token(api_server):
    tenant, key = api_server.new_tenant()
    body = {"model": api_server.state.model_id, "prompt": "hello", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    client = httpx.Client(base_url=api_server.url, headers={"Authorization": f"Bearer {key}"})
    errors = []

    def send() -> None:
        try:
            client.post("/v1/completions", json=body)
        except httpx.HTTPError as e:
            errors.append(e)

    with api_server.engine_throttled(), api_server.engine_paused():
        sender = threading.Thread(target=send)
        sender.start()
        _wait_for(lambda: api_server.state.limiter.current(api_server.state.tenants.get(tenant))["concurrent_requests"] == 1)
        client.close()  # hang up while the request waits for the engine
        sender.join(10)
    _wait_for(lambda: _aborted(api_server, tenant) == 1)
    _wait_for(lambda: api_server.state.engine.stats().kv_blocks.used == 0)
    _wait_for(lambda: api_server.state.limiter.current(api_server.state.tenants.get(tenant))["concurrent_requests"] == 0)


def test_non_streaming_disconnect_aborts_too(api_server):
    tenant, key = api_server.new_tenant()
    body = {"model": api_server.state.model_id, "prompt": "hello", "max_tokens": 400, "ignore_eos": True}
    with api_server.engine_throttled():
        try:
            httpx.post(f"{api_server.url}/v1/completions", json=body, timeout=0.5,
                       headers={"Authorization": f"Bearer {key}"})
        except httpx.ReadTimeout:
            pass
        _wait_for(lambda: _aborted(api_server, tenant) == 1)
        _wait_for(lambda: api_server.state.engine.stats().kv_blocks.used == 0)
