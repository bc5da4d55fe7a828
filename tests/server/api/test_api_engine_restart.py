"""--engine-restart (--engine-process separate): a kill -9 of the engine core mid-stream ends the stream
with an SSE error event and [DONE], /health turns 503 within about a second and new requests get 503 with
Retry-After while a new core starts; usage is settled for the tokens the stream delivered, no lease or
running request is left behind (nor a concurrency lease in Redis), and once /health is 200 again the same greedy requests, on the base and
on an adapter uploaded before (paged in again from the registry), give the same tokens as before the
kill. Past --engine-restart-limit the client gives up (the CLI then exits 1: test_api_engine_process)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from server.demo import make_adapter, make_base_model
from tests.fixtures_server import api_redis_url, read_sse, running_server, server_config


@pytest.fixture()
def long_model(tmp_path):
    """The tiny llama with room for a stream that is still running when the core is killed."""
    model = make_base_model(tmp_path / "model", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=128, max_position_embeddings=8192)
    return model, make_adapter(model, tmp_path / "adapter", r=8, lora_alpha=16, seed=22)


def _wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, what
        time.sleep(0.02)
    return time.monotonic() - start


def _greedy(handle, key: str, model: str) -> list:
    with handle.http(key) as h:
        out = []
        for prompt in ("once upon", [5, 6, 7]):
            r = h.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["logprobs"]["tokens"])
        return out


def test_kill_9_of_the_core_restarts_it_and_settles_the_stream(long_model, redis_server, tmp_path, core_starter):
    model_dir, adapter_dir = long_model
    config = server_config(model_dir, tmp_path / "data", api_redis_url(redis_server), engine_process="separate",
                           engine_restart_limit=1, kv_cache_blocks=520, max_model_len=8192,
                           usage_settle_interval=0.2)
    with running_server(config, starter=core_starter) as handle:
        _, key = handle.new_tenant()
        assert handle.upload(key, "ad", adapter_dir).status_code == 201
        base = handle.state.model_id
        before = {m: _greedy(handle, key, m) for m in (base, "ad")}
        events, first = [], threading.Event()
        body = {"model": "ad", "prompt": [5, 6, 7], "max_tokens": 8000, "ignore_eos": True, "stream": True,
                "logprobs": 1}
        reader = threading.Thread(target=read_sse, args=(f"{handle.url}/v1/completions",
                                                         {"Authorization": f"Bearer {key}"}, body, events, first),
                                  daemon=True)
        reader.start()
        assert first.wait(60)
        old_pid = handle.state.engine.core_pid
        os.kill(old_pid, signal.SIGKILL)
        seen = _wait(lambda: httpx.get(f"{handle.url}/health", timeout=5).status_code == 503, 10, "/health 200")
        assert seen < 1.5, f"/health turned 503 {seen:.2f} s after the kill"
        health = httpx.get(f"{handle.url}/health", timeout=5).json()
        assert health["engine_restarting"] is True and "exited" in health["engine_error"], health
        r = httpx.post(f"{handle.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": base, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        reader.join(10)
        assert events[-1] == "closed" and events[-2] == "[DONE]", events[-3:]
        assert json.loads(events[-3])["error"]["code"] == "engine_unavailable"
        delivered = sum(len(json.loads(e)["choices"][0]["logprobs"]["tokens"])
                        for e in events[:-3] if json.loads(e).get("choices"))
        assert delivered > 0

        _wait(lambda: httpx.get(f"{handle.url}/health", timeout=5).status_code == 200, 120, "no new core")
        assert handle.state.engine.core_pid != old_pid and handle.state.engine.restarts == 1
        assert {m: _greedy(handle, key, m) for m in (base, "ad")} == before

        # Settled for what the stream delivered (4 requests of 8 tokens before, 4 after), nothing left running.
        def settled() -> bool:
            with handle.http(key) as h:
                return h.get("/v1/usage").json()["total"]["completion_tokens"] == delivered + 8 * 8
        _wait(settled, 10, "the stream's tokens were not settled")
        assert handle.state.settlements.running == 0 and handle.state.settlements.leases_lost == 0
        with handle.http(key) as h:  # the killed stream's concurrency lease is gone from Redis too
            assert h.get("/v1/usage").json()["current"]["concurrent_requests"] == 0
        assert handle.state.engine.stats().scheduler.running == 0

        # A second death within the window is past --engine-restart-limit 1: gone for good.
        os.kill(handle.state.engine.core_pid, signal.SIGKILL)
        _wait(lambda: handle.state.engine.gave_up, 5, "restarted past the limit")
        assert not handle.state.engine.is_restarting and not handle.state.engine.is_healthy
        health = httpx.get(f"{handle.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["engine_restarting"] is False
