"""--data-parallel-size 2 against the real server (tiny random llama, real Redis): greedy outputs for a
mix of adapters and the base are token-identical to one engine core; a repeat adapter goes to the core
it is resident on; a tenant's quota holds across the cores; a kill -9 of one core ends only its own
streams while the other core's run to the end, and the killed one is restarted."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.demo import make_adapter, make_base_model
from server.engine.data_parallel.client import PLACED_S, REFRESH_S
from tests.fixtures_server import api_redis_url, read_sse, running_server, server_config

ADAPTERS = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny llama with room for a stream still running when a core is killed, and five adapters."""
    root = tmp_path_factory.mktemp("dp-model")
    model_dir = make_base_model(root / "model", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=128, max_position_embeddings=8192)
    return model_dir, [make_adapter(model_dir, root / f"a{i}", r=8, lora_alpha=16, seed=30 + i)
                       for i in range(ADAPTERS)]


def _config(model_dir, data_dir, redis_server, **overrides):
    return server_config(model_dir, data_dir, api_redis_url(redis_server), engine_process="separate",
                         kv_cache_blocks=520, max_model_len=8192, **overrides)


def _uploaded(handle, adapters, name: str | None = None) -> str:
    _, key = handle.new_tenant(name=name)
    for i, adapter_dir in enumerate(adapters):
        assert handle.upload(key, f"a{i}", adapter_dir).status_code == 201
    return key


@pytest.fixture(scope="module")
def one_core_outputs(model, redis_server, tmp_path_factory, core_starter):
    """The mixed requests' outputs from one engine core (before the DP server: each flushes the API db)."""
    model_dir, adapters = model
    with running_server(_config(model_dir, tmp_path_factory.mktemp("one-data"), redis_server),
                        starter=core_starter) as one:
        return _mixed(one, _uploaded(one, adapters))


@pytest.fixture(scope="module")
def dp_server(model, redis_server, tmp_path_factory, one_core_outputs, core_starter):
    model_dir, adapters = model
    with running_server(_config(model_dir, tmp_path_factory.mktemp("dp-data"), redis_server,
                                data_parallel_size=2), starter=core_starter) as handle:
        yield handle, _uploaded(handle, adapters, name="acme")


def _complete(handle, key: str, model: str, prompt, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{handle.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "logprobs": 1})


def _mixed(handle, key: str) -> list:
    """Every adapter and the base, two prompts each, all at once (mixed batches on every core)."""
    jobs = [(m, p) for m in [handle.state.model_id] + [f"a{i}" for i in range(ADAPTERS)]
            for p in ("once upon", [5, 6, 7])]
    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(lambda job: _complete(handle, key, *job), jobs))
    out = []
    for r in responses:
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["logprobs"]
        out.append((logprobs["tokens"], logprobs["token_logprobs"]))
    return out


def _routed_to(handle, key: str, model: str) -> int:
    engine = handle.state.engine
    before = list(engine.routed)
    assert _complete(handle, key, model, [5, 6, 7], max_tokens=2).status_code == 200
    changed = [i for i, (a, b) in enumerate(zip(before, engine.routed)) if a != b]
    assert len(changed) == 1, (before, engine.routed)
    return changed[0]


def test_outputs_token_identical_to_one_core(dp_server, one_core_outputs):
    handle, key = dp_server
    two = _mixed(handle, key)
    assert all(handle.state.engine.routed), handle.state.engine.routed  # both cores served some
    reference = one_core_outputs
    assert [tokens for tokens, _ in two] == [tokens for tokens, _ in reference]
    for (_, got), (_, want) in zip(two, reference):
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


def test_a_repeat_adapter_goes_to_the_core_it_is_resident_on(dp_server):
    handle, key = dp_server
    time.sleep(PLACED_S + 2 * REFRESH_S)  # the router reads the cores' slots, not its routing record
    # Five adapters, four slots a core: one core cannot hold them all, so some live on core 1, where
    # least-loaded routing would never send a request while both cores are idle (the lowest index wins).
    homes = {f"a{i}": _routed_to(handle, key, f"a{i}") for i in range(ADAPTERS)}
    assert set(homes.values()) == {0, 1}, homes
    time.sleep(PLACED_S + 2 * REFRESH_S)
    for name, home in homes.items():
        assert name in {"a0", "a1", "a2", "a3", "a4"}
        for _ in range(2):
            assert _routed_to(handle, key, name) == home, (name, homes)
    views = handle.state.engine.views()
    assert len(views[0].device) + len(views[1].device) >= ADAPTERS


def test_a_tenants_quota_holds_across_the_cores(dp_server):
    handle, _ = dp_server
    _, key = handle.new_tenant({"requests_per_minute": 4})
    before = list(handle.state.engine.routed)
    with ThreadPoolExecutor(6) as pool:  # at once: the least loaded core differs between them
        codes = sorted(pool.map(lambda _: _complete(handle, key, handle.state.model_id, [5, 6],
                                                    max_tokens=64).status_code, range(6)))
    assert codes == [200] * 4 + [429] * 2, codes
    assert all(b > a for a, b in zip(before, handle.state.engine.routed)), (before, handle.state.engine.routed)


def test_pins_reach_every_core_and_each_core_has_its_engine_label(dp_server):
    handle, key = dp_server
    engine = handle.state.engine
    assert handle.admin("PUT", "/admin/tenants/acme/adapters/a2/pin").status_code == 200
    assert [core.snapshot.stats.slots.pinned for core in engine.engine_cores()] == [1, 1]
    assert handle.admin("DELETE", "/admin/tenants/acme/adapters/a2/pin").status_code == 200
    assert [core.snapshot.stats.slots.pinned for core in engine.engine_cores()] == [0, 0]

    view = handle.admin("GET", "/admin/engine").json()
    assert [core["engine"] for core in view["engines"]] == [0, 1]
    assert view["slots"]["total"] == sum(core["slots"]["total"] for core in view["engines"]) == 8
    assert view["kv_blocks"]["total"] == sum(core["kv_blocks"]["total"] for core in view["engines"])
    assert all(core["routed"] > 0 and core["healthy"] for core in view["engines"])
    families = {f.name: f for f in text_string_to_metric_families(handle.admin("GET", "/metrics").text)}
    up = {s.labels["engine"]: s.value for s in families["loraplex_engine_core_up"].samples}
    assert up == {"0": 1.0, "1": 1.0}
    routed = {s.labels["engine"]: s.value for s in families["loraplex_engine_core_routed_requests"].samples}
    assert routed == {str(i): float(n) for i, n in enumerate(engine.routed)}
    (slots,) = families["vllm:max_gpu_lora_adapters"].samples  # the server's: both cores' slots
    assert slots.value == 8


def test_killing_one_core_leaves_the_others_streams_running(dp_server):
    handle, key = dp_server
    engine = handle.state.engine
    time.sleep(PLACED_S + 2 * REFRESH_S)
    streams = []
    for model in ("a0", handle.state.model_id):  # a0 to its core; the base then to the idle other one
        events, first = [], threading.Event()
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True,
                "temperature": 0}
        threading.Thread(target=read_sse, args=(f"{handle.url}/v1/completions", {"Authorization": f"Bearer {key}"},
                                                body, events, first), daemon=True).start()
        assert first.wait(60)
        streams.append(events)
    busy = [i for i, n in enumerate(engine._in_flight) if n]
    assert sorted(busy) == [0, 1], engine._in_flight
    victim = engine.cores[0]
    old_pid, restarts = victim.core_pid, victim.restarts
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while victim.is_healthy:
        assert time.monotonic() < deadline, "the killed core was never noticed"
        time.sleep(0.02)
    assert httpx.get(f"{handle.url}/health", timeout=5).status_code == 200  # the other core serves
    assert _complete(handle, key, "a1", [5, 6], max_tokens=2).status_code == 200
    deadline = time.monotonic() + 120
    while streams[0][-1:] != ["closed"] or streams[1][-1:] != ["closed"]:
        assert time.monotonic() < deadline, "a stream never ended"
        time.sleep(0.05)
    killed, survivor = ([s for s in streams if any('"error"' in e for e in s)],
                        [s for s in streams if not any('"error"' in e for e in s)])
    assert len(killed) == 1 and len(survivor) == 1, [s[-3:] for s in streams]
    assert json.loads(killed[0][-3])["error"]["code"] == "engine_unavailable"
    assert survivor[0][-2] == "[DONE]"
    assert json.loads(survivor[0][-3])["choices"][0]["finish_reason"] == "length"
    while not victim.is_healthy:
        assert time.monotonic() < deadline, "the killed core was not restarted"
        time.sleep(0.05)
    assert victim.core_pid != old_pid and victim.restarts == restarts + 1
    assert engine.cores[1].restarts == 0
    assert _routed_to(handle, key, "a0") in (0, 1)
