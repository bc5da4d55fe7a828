"""A tensor-parallel worker killed mid-stream (`--tensor-parallel-size 2`, the engine core in its own
process, --engine-restart on): the step that needed it fails the engine core instead of hanging in a
collective, the stream ends with the SSE error event and [DONE], the core and its workers are started
again, and the same greedy requests give the same tokens as before the kill."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from server.demo import make_adapter, make_base_model
from tests.fixtures_server import api_redis_url, read_sse, running_server, server_config

PROMPT = [5, 17, 99, 23, 41]


def _wait(predicate, timeout: float, what: str) -> None:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, what
        time.sleep(0.05)


def _tp_workers(core_pid: int) -> list[psutil.Process]:
    """The engine core's spawned tensor-parallel ranks (torch.multiprocessing spawn children)."""
    return [p for p in psutil.Process(core_pid).children()
            if any("multiprocessing" in part for part in p.cmdline())]


def _greedy(handle, key: str, model: str) -> list:
    with handle.http(key) as http:
        r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.fixture()
def long_model(tmp_path):
    """The tiny llama with room for a stream that is still running when the worker is killed."""
    model = make_base_model(tmp_path / "model", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=128, max_position_embeddings=8192)
    return model, make_adapter(model, tmp_path / "adapter", r=8, lora_alpha=16, seed=22)


def test_killed_worker_fails_the_core_which_restarts(long_model, redis_server, tmp_path, core_starter):
    model_dir, adapter_dir = long_model
    config = server_config(model_dir, tmp_path / "data", api_redis_url(redis_server), engine_process="separate",
                           tensor_parallel_size=2, engine_restart_limit=2, kv_cache_blocks=520, max_model_len=8192,
                           served_model_name="tiny-base")
    with running_server(config, starter=core_starter) as handle:
        _, key = handle.new_tenant()
        assert handle.upload(key, "r8_all", adapter_dir).status_code == 201
        before = {m: _greedy(handle, key, m) for m in ("tiny-base", "r8_all")}

        old_core = handle.state.engine.core_pid
        workers = _tp_workers(old_core)
        assert len(workers) == 1, [w.cmdline() for w in workers]
        events, first = [], threading.Event()
        body = {"model": "r8_all", "prompt": PROMPT, "max_tokens": 8000, "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=read_sse, args=(f"{handle.url}/v1/completions",
                                                         {"Authorization": f"Bearer {key}"}, body, events, first),
                                  daemon=True)
        reader.start()
        assert first.wait(60)
        os.kill(workers[0].pid, signal.SIGKILL)

        reader.join(60)
        assert not reader.is_alive(), "the stream hung after its tensor-parallel worker died"
        assert events[-1] == "closed" and events[-2] == "[DONE]", events[-3:]
        assert json.loads(events[-3])["error"]["code"] == "engine_unavailable", events[-3]

        _wait(lambda: handle.state.engine.core_pid not in (None, old_core)
              and httpx.get(f"{handle.url}/health", timeout=5).status_code == 200, 180, "no new engine core")
        assert handle.state.engine.restarts >= 1
        assert not psutil.pid_exists(old_core) or psutil.Process(old_core).status() == psutil.STATUS_ZOMBIE
        assert len(_tp_workers(handle.state.engine.core_pid)) == 1
        assert {m: _greedy(handle, key, m) for m in ("tiny-base", "r8_all")} == before
