"""The inference gateway's contract on /metrics: the metric and label names the Gateway API Inference
Extension's model-server protocol and the llm-d router's vllm engine config read, running and waiting
adapter lists that differ when requests wait, and residency series that equal the engine's tiers after
loads and evictions (two device slots, a host budget of two adapters, two sequences at a time)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.embedded_redis.server import free_port
from tests.fixtures_server import api_redis_url, running_server, server_config

# Copied from the protocol (kubernetes-sigs/gateway-api-inference-extension,
# docs/proposals/003-model-server-protocol, and llm-d/llm-d-router docs/plugin-metric-protocol.md and the
# core-metrics-extractor's "vllm" engine config): metric -> (type, the labels the router reads).
PROTOCOL = {
    "vllm:num_requests_waiting": ("gauge", set()),
    "vllm:num_requests_running": ("gauge", set()),
    "vllm:kv_cache_usage_perc": ("gauge", set()),
    "vllm:lora_requests_info": ("gauge", {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}),
    "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks"}),
}
NAMES = ("r4_qv", "r8_all", "r16_rslora", "r32_pattern")


@pytest.fixture(scope="module")
def gateway_server(tiny_model_dir, tiny_adapters, redis_server, tmp_path_factory, core_starter):
    # In-process: the residency test compares the series with the engine's own slot and host tables.
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("gateway"), api_redis_url(redis_server),
                           max_loras=2, max_num_seqs=2, engine_process="in-process")
    with running_server(config, starter=core_starter) as probe:  # the stored sizes, for a host budget of two adapters
        name, key = probe.new_tenant()
        sizes = [probe.upload(key, n.replace("_", "-"), tiny_adapters[n]).json()["size_bytes"] for n in NAMES]
        tenant_id = probe.admin("GET", f"/admin/tenants/{name}").json()["id"]
    budget = sum(sorted(sizes)[-2:])
    with running_server(config.with_settings(port=free_port(), max_cpu_lora_bytes=budget),
                        starter=core_starter) as server:
        yield server, key, tenant_id, sum(sizes)


def _families(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(server.admin("GET", "/metrics").text)}


def _labels(family) -> list[dict]:
    return [s.labels for s in family.samples]


def _wait_idle(server) -> None:
    deadline = time.monotonic() + 60
    while (s := server.state.engine.stats()).scheduler.running or s.scheduler.waiting or s.host.loading:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.02)


def test_metrics_carry_the_protocols_names_and_labels(gateway_server):
    server, key, _, _ = gateway_server
    families = _families(server)
    model = server.state.model_id
    for name, (kind, labels) in PROTOCOL.items():
        family = families[name]
        assert family.type == kind, name
        for sample_labels in _labels(family):
            assert labels <= set(sample_labels), name
            if not labels:
                assert sample_labels == {"model_name": model}
    [lora] = _labels(families["vllm:lora_requests_info"])
    assert set(lora) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"} and lora["max_lora"] == "2"
    [cache] = _labels(families["vllm:cache_config_info"])
    pool = server.state.engine.info.kv_pool
    assert (cache["block_size"], cache["num_gpu_blocks"]) == (str(pool.block_size), str(pool.blocks))
    assert [s.value for s in families["vllm:max_gpu_lora_adapters"].samples] == [2]
    assert families["vllm:lora_adapter_loaded"].type == "gauge"
    # Set only once the engine has said where adapters are (in-process or from an engine core).
    assert [s.value for s in families["vllm:num_gpu_loaded_lora_adapters"].samples] == [0]
    assert families["vllm:lora_adapter_load_seconds"].type == "histogram"
    # The names name tenants' adapters: no tenant reads them, nor anyone without a token.
    with server.http(key) as h:
        assert h.get("/metrics").status_code == 403
    with server.http() as h:
        assert h.get("/metrics").status_code == 401


def test_waiting_list_is_the_waiting_requests_adapters(gateway_server):
    server, key, tenant_id, _ = gateway_server
    client = server.client(key)

    def generate(model: str) -> None:
        client.completions.create(model=model, prompt="hello there", max_tokens=120, temperature=0,
                                  extra_body={"ignore_eos": True})

    with server.engine_throttled(0.05), ThreadPoolExecutor(len(NAMES)) as pool:
        futures = [pool.submit(generate, n.replace("_", "-")) for n in NAMES]
        deadline = time.monotonic() + 60
        while not ((sched := server.state.engine.stats().scheduler).running == 2 and sched.waiting == 2):
            assert time.monotonic() < deadline, "two requests never ran while two waited (max_num_seqs 2)"
            time.sleep(0.02)
        with server.engine_paused():  # between steps: the published state holds still
            stats = server.state.engine.stats().scheduler
            [lora] = _labels(_families(server)["vllm:lora_requests_info"])
        for f in futures:
            f.result(120)
    version = {f"{tenant_id}/{r.name}": r.version for r in server.state.registry.list(tenant_id)}
    running = set(filter(None, lora["running_lora_adapters"].split(",")))
    waiting = set(filter(None, lora["waiting_lora_adapters"].split(",")))
    assert {version[n] for n in running} == stats.running_adapters and len(running) == 2
    assert {version[n] for n in waiting} == stats.waiting_adapters and len(waiting) == 2
    assert running != waiting and running | waiting == {f"{tenant_id}/{n.replace('_', '-')}" for n in NAMES}


def test_residency_series_equal_the_engines_tiers_through_evictions(gateway_server):
    server, key, tenant_id, stored_bytes = gateway_server
    client = server.client(key)
    engine = server.state.engine.engine
    label = {r.version: f"{tenant_id}/{r.name}" for r in server.state.registry.list(tenant_id)}
    model = server.state.model_id
    for name in NAMES + NAMES[:2]:  # four adapters through two slots and a two-adapter host budget, twice
        out = client.completions.create(model=name.replace("_", "-"), prompt="hi", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2
        _wait_idle(server)
        families = _families(server)
        loaded = {(s.labels["adapter_name"], s.labels["level"]) for s in families["vllm:lora_adapter_loaded"].samples
                  if s.value == 1}
        expected = ({(label[v], "gpu") for v in engine.lora_slots.slot_of}
                    | {(label[v], "cpu") for v in engine.host.entries})
        assert loaded == expected
        gpu = {n for n, level in loaded if level == "gpu"}
        assert [s.value for s in families["vllm:num_gpu_loaded_lora_adapters"].samples] == [len(gpu)]
        assert families["vllm:num_gpu_loaded_lora_adapters"].samples[0].labels == {"model_name": model}
    stats = server.state.engine.stats()
    assert stats.slots.evictions >= 2 and stats.host.evictions >= 2  # both tiers evicted along the way
    assert len(engine.lora_slots.slot_of) == 2
    families = _families(server)
    names = [f"loraplex_adapter_tier_{n}" for n in ("hits", "misses", "evictions", "resident", "bytes", "hit_rate")]
    tier = {(name, s.labels["tier"]): s.value for name in names for s in families[name].samples}
    # The store tier: the four versions in Redis and their stored bytes.
    assert (tier[("loraplex_adapter_tier_resident", "store")], tier[("loraplex_adapter_tier_bytes", "store")]) == (
        len(NAMES), stored_bytes)
    assert tier[("loraplex_adapter_tier_bytes", "host")] == stats.host.bytes_used
    assert tier[("loraplex_adapter_tier_misses", "device")] == stats.slots.loads
    assert tier[("loraplex_adapter_tier_evictions", "host")] == stats.host.evictions
    host_rate = stats.host.hits / (stats.host.hits + stats.host.misses)
    assert tier[("loraplex_adapter_tier_hit_rate", "host")] == pytest.approx(host_rate)
    device_rate = stats.slots.hits / (stats.slots.hits + stats.slots.loads)
    assert tier[("loraplex_adapter_tier_hit_rate", "device")] == pytest.approx(device_rate)
    # Every Redis -> host load went into the cpu level's histogram, every copy into a slot into the gpu
    # level's (each scrape took the new ones).
    count = {s.labels["level"]: s.value for s in families["vllm:lora_adapter_load_seconds"].samples
             if s.name.endswith("_count")}
    assert count == {"cpu": stats.host.loads, "gpu": stats.slots.loads}
    view = server.admin("GET", "/admin/engine").json()
    assert view["slots"]["evictions"] == stats.slots.evictions and view["slots"]["misses"] == stats.slots.loads
    assert view["slots"]["hit_rate"] == pytest.approx(device_rate)
    assert view["host"]["evictions"] == stats.host.evictions and view["host"]["hits"] == stats.host.hits
    assert view["host"]["hit_rate"] == pytest.approx(host_rate)
    assert (view["store"]["adapters"], view["store"]["bytes"]) == (len(NAMES), stored_bytes)
