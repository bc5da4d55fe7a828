"""A server started with --async-scheduling (server.engine.async_step): concurrent streams over an adapter
and the base model give the synchronous engine's text and usage, and a client that hangs up mid-stream
is aborted with its KV freed and only the tokens it got charged."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server.engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.fixtures_server import api_redis_url, running_server, server_config

VOCAB = 512


@pytest.fixture(scope="module")
def async_server(tmp_path_factory, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("async-data"), api_redis_url(redis_server),
                           async_scheduling=True)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _stream(server, key: str, body: dict) -> tuple[str, dict]:
    """The streamed text and the usage chunk of one completion."""
    text, usage = "", None
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                text += "".join(choice["text"] for choice in chunk["choices"])
                usage = chunk["usage"] or usage
    return text, usage


def test_concurrent_streams_match_the_synchronous_engine(async_server, tiny_model_dir, tiny_adapters):
    _, key = async_server.new_tenant()
    assert async_server.upload(key, "r8", tiny_adapters["r8_all"]).status_code == 201
    prompts = random_prompts(6, (5, 20), VOCAB, seed=21)
    names = ["r8", None] * 3
    max_tokens = [9, 14, 5, 20, 12, 7]
    model = async_server.state.model_id
    results: dict[int, tuple[str, dict]] = {}

    def send(i: int) -> None:
        results[i] = _stream(async_server, key, {"model": names[i] or model, "prompt": prompts[i],
                                                 "max_tokens": max_tokens[i], "temperature": 0.0,
                                                 "ignore_eos": True})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    sync = LLM(tiny_model_dir, device="cpu", max_loras=4, kv_cache_blocks=64, max_model_len=512, max_lora_rank=32)
    sync.add_adapter("r8", tiny_adapters["r8_all"])
    want = sync.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens],
                         adapters=names)
    for i, out in enumerate(want):
        text, usage = results[i]
        assert text == out.text
        assert usage["completion_tokens"] == max_tokens[i] and usage["prompt_tokens"] == len(prompts[i])
    view = async_server.admin("GET", "/admin/engine").json()["async_scheduling"]
    assert view["enabled"] is True and view["steps"] > view["steps_ahead"] > 0
    metrics = async_server.admin("GET", "/metrics").text
    assert f"loraplex_async_steps_ahead_total {float(view['steps_ahead'])}" in metrics


def test_hanging_up_mid_stream_aborts_and_frees_kv(async_server):
    _, key = async_server.new_tenant()
    body = {"model": async_server.state.model_id, "prompt": [7] * 100, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with async_server.engine_throttled():
        with httpx.Client(base_url=async_server.url, headers={"Authorization": f"Bearer {key}"}) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 15
    while async_server.state.engine.stats().kv_blocks.used or async_server.state.engine.stats().scheduler.running:
        assert time.monotonic() < deadline, "the aborted request kept its KV blocks"
        time.sleep(0.02)
    with async_server.http(key) as h:
        usage = h.get("/v1/usage").json()
    assert 1 <= usage["total"]["completion_tokens"] < 400
    assert usage["current"]["concurrent_requests"] == 0
