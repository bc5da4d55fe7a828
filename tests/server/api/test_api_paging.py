"""Adapter paging through the server: two processes' worth of servers on one Redis, delete while in use."""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace

import httpx

from server.embedded_redis.server import free_port
from tests.fixtures_server import api_redis_url, running_server, server_config


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def metric(text: str, name: str, tier: str | None = None) -> float:
    label = f'{name}{{tier="{tier}"}} ' if tier else f"{name} "
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(label)))


def test_delete_in_use_on_another_server(tiny_model_dir, tiny_adapters, redis_server, tmp_path, core_starter):
    config = server_config(tiny_model_dir, tmp_path / "a", api_redis_url(redis_server))
    with running_server(config, starter=core_starter) as a, \
            running_server(replace(config, port=free_port(), data_dir=tmp_path / "b"), starter=core_starter) as b:
        _, key = a.new_tenant()
        version = a.upload(key, "ad", tiny_adapters["r8_all"]).json()["version"]
        warm = b.client(key).completions.create(model="ad", prompt="hi", max_tokens=2, temperature=0)
        assert warm.usage.completion_tokens == 2
        engine_b = b.state.engine
        assert version in engine_b.held_adapter_versions(10)  # paged into b's tiers from Redis
        body = {"model": "ad", "prompt": [5] * 20, "max_tokens": 60, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        with b.engine_throttled(), httpx.Client(base_url=b.url, headers={"Authorization": f"Bearer {key}"},
                                                timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                with a.http(key) as h:  # deleted through the other server while b is generating with it
                    assert h.delete("/v1/adapters/ad").status_code == 200
                events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 60  # the running request finished
        assert [e for e in events if e["choices"]][-1]["choices"][0]["finish_reason"] == "length"
        # b heard of the delete through Redis pub/sub: the version left every tier.
        wait_for(lambda: version not in engine_b.held_adapter_versions(10))  # every tier, device slots too
        assert engine_b.stats().host.bytes_used == 0
        with b.http(key) as h:
            assert h.post("/v1/completions", json={"model": "ad", "prompt": "x"}).status_code == 404
        text = b.admin("GET", "/metrics").text
        assert metric(text, "loraplex_adapter_tier_misses", "host") == 1
        assert metric(text, "loraplex_adapter_tier_hits", "host") == 1
        assert metric(text, "loraplex_adapter_tier_misses", "device") >= 1
        assert metric(text, "loraplex_adapter_tier_resident", "host") == 0
        assert metric(text, "loraplex_adapter_load_seconds_count") == 1


def test_host_budget_is_respected_over_http(tiny_model_dir, tiny_adapters, redis_server, tmp_path, core_starter):
    sizes = {}
    config = server_config(tiny_model_dir, tmp_path, api_redis_url(redis_server), max_loras=1)
    with running_server(config, starter=core_starter) as probe:
        _, key = probe.new_tenant()
        for name in ("r4_qv", "r8_all", "r16_rslora"):
            sizes[name] = probe.upload(key, name.replace("_", "-"), tiny_adapters[name]).json()["size_bytes"]
    budget = sizes["r16_rslora"] + sizes["r4_qv"]  # never all three at once
    with running_server(config.with_settings(port=free_port(), max_cpu_lora_bytes=budget), starter=core_starter) as s:
        client = s.client(key)
        for _ in range(2):
            for name in ("r4-qv", "r8-all", "r16-rslora"):
                out = client.completions.create(model=name, prompt="hello", max_tokens=3, temperature=0)
                assert out.usage.completion_tokens == 3
                assert s.state.engine.stats().host.bytes_used <= budget
        stats = s.state.engine.stats()
        assert stats.host.evictions >= 2 and stats.slots.evictions >= 2


def test_idle_server_frees_retired_versions_after_grace(tiny_model_dir, tiny_adapters, redis_server, tmp_path,
                                                        core_starter):
    config = server_config(tiny_model_dir, tmp_path, api_redis_url(redis_server), adapter_grace_seconds=1.0)
    with running_server(config, starter=core_starter) as s:
        _, key = s.new_tenant()
        assert s.upload(key, "gone", tiny_adapters["r4_qv"]).status_code == 201
        prefix = config.redis_prefix
        redis = s.state.redis
        assert list(redis.scan_iter(f"{prefix}ad:chunk:*"))
        with s.http(key) as h:
            assert h.delete("/v1/adapters/gone").status_code == 200
        # No further writes: the server's own periodic collection frees the chunks.
        wait_for(lambda: not list(redis.scan_iter(f"{prefix}ad:chunk:*"))
                 and not list(redis.scan_iter(f"{prefix}ad:ver:*")), timeout=10)


def test_engine_crash_fails_requests_with_503_and_health_says_so(tiny_model_dir, redis_server, tmp_path, core_starter):
    config = server_config(tiny_model_dir, tmp_path, api_redis_url(redis_server), engine_restart=False)
    with running_server(config, starter=core_starter) as s:
        _, key = s.new_tenant()
        with s.http(key) as h:
            assert h.get("/health").status_code == 200
            if config.engine_process == "separate":
                os.kill(s.state.engine.core_pid, signal.SIGKILL)  # the core is gone (not restarted)
            else:
                def broken_step():
                    raise RuntimeError("simulated engine fault")

                s.state.engine.engine.step = broken_step  # the next step crashes the engine loop
            r = h.post("/v1/completions", json={"model": s.state.model_id, "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503 and "error" in r.json()
            wait_for(lambda: h.get("/health").status_code == 503)
            again = h.post("/v1/completions", json={"model": s.state.model_id, "prompt": "hi", "max_tokens": 4})
            assert again.status_code == 503  # refused at once, not hung
            with s.http(key) as h2:
                assert h2.get("/v1/usage").json()["current"]["concurrent_requests"] == 0
