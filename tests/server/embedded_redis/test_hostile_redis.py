"""Redis going away mid-traffic: the server answers 503 with Retry-After (never 500), /health says so,
and everything recovers by itself when Redis is back: requests, settled leases and usage, and the
adapter-event subscription (resynchronised for what it missed)."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx
import pytest

from server.embedded_redis.server import EmbeddedRedis, free_port
from tests.fixtures_server import running_server, server_config

TOKENS = 300  # the stream in flight: long enough to still run when the engine is paused after its first token


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.fixture
def own_redis(tmp_path):
    """A Redis of this test's own: killing it must not disturb the session's."""
    with EmbeddedRedis.start(tmp_path / "redis") as server:
        yield server


def _health(server) -> httpx.Response:
    with server.http() as h:
        return h.get("/health")


def test_redis_outage_answers_503_and_recovers(tiny_model_dir, tiny_adapters, own_redis, tmp_path, core_starter):
    config = server_config(tiny_model_dir, tmp_path / "data", own_redis.url_for(1))
    with running_server(config, starter=core_starter) as server:
        name, key = server.new_tenant({"max_concurrent_requests": 4})
        assert server.upload(key, "ad", tiny_adapters["r8_all"]).status_code == 201
        model = server.state.model_id
        body = {"model": "ad", "prompt": [5] * 10, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        subscriptions = server.state.retirements.subscriptions
        with server.engine_throttled(), httpx.Client(base_url=server.url, timeout=60,
                                                     headers={"Authorization": f"Bearer {key}"}) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                with own_redis.pause_supervision():
                    # Paused while Redis goes: under load a throttled 40-token stream ran free and settled first.
                    with server.engine_paused():
                        assert server.state.engine.stats().scheduler.running == 1, "the stream ended too soon"
                        own_redis.kill()
                    # Everything that needs Redis is a 503 with Retry-After, not a 500.
                    for method, path, token in [("POST", "/v1/completions", key), ("GET", "/v1/models", key),
                                                ("GET", "/v1/usage", key), ("GET", "/v1/adapters", key),
                                                ("GET", "/admin/tenants", server.config.admin_token)]:
                        answer = c.request(method, path, headers={"Authorization": f"Bearer {token}"},
                                           json={"model": model, "prompt": "hi", "max_tokens": 2})
                        assert answer.status_code == 503, (path, answer.text)
                        assert int(answer.headers["retry-after"]) >= 1
                        assert answer.json()["error"]["code"] == "store_unavailable"
                    health = _health(server)
                    assert health.status_code == 503 and health.json()["redis"] is False
                    # The stream in flight needs no Redis: it finishes, and settles later.
                    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
                    assert events[-1]["usage"]["completion_tokens"] == TOKENS
                    wait_for(lambda: server.state.settlements.pending == 1)
        # Redis is back (same data, from its AOF): everything recovers on its own.
        own_redis.wait_until_up()
        wait_for(lambda: _health(server).status_code == 200)
        assert _health(server).json()["redis"] is True
        wait_for(lambda: server.state.settlements.pending == 0)
        tenant = server.state.tenants.get(name)
        assert server.state.limiter.current(tenant)["concurrent_requests"] == 0  # no leaked lease
        out = server.client(key).completions.create(model="ad", prompt="hi", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        with server.http(key) as h:
            usage = h.get("/v1/usage").json()
        assert usage["total"]["requests"] == 2 and usage["total"]["completion_tokens"] == TOKENS + 3
        wait_for(lambda: server.state.retirements.subscriptions > subscriptions)


def test_adapter_events_missed_while_unsubscribed_are_resynchronised(tiny_model_dir, tiny_adapters,
                                                                      own_redis, tmp_path, core_starter):
    config = server_config(tiny_model_dir, tmp_path / "a", own_redis.url_for(1))
    with running_server(config, starter=core_starter) as a, \
            running_server(replace(config, port=free_port(), data_dir=tmp_path / "b"), starter=core_starter) as b:
        _, key = a.new_tenant()
        version = a.upload(key, "ad", tiny_adapters["r4_qv"]).json()["version"]
        assert b.client(key).completions.create(model="ad", prompt="hi", max_tokens=2).usage
        engine_b = b.state.engine
        assert version in engine_b.held_adapter_versions(10)
        listener = b.state.retirements
        wait_for(listener.connected.is_set)
        listener.stop()  # as while Redis was away: b hears nothing
        with a.http(key) as h:
            assert h.delete("/v1/adapters/ad").status_code == 200  # the event is published to nobody
        time.sleep(0.3)
        assert version in engine_b.held_adapter_versions(10)
        # Every (re)subscription asks the registry about what b holds: the version leaves its tiers.
        listener.start()
        wait_for(lambda: version not in engine_b.held_adapter_versions(10))
        assert listener.resynced == 1
