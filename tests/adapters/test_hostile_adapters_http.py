"""Hostile adapter uploads through a real server: values that would poison the engine are refused
at upload with the reason; one stored anyway fails only its own requests; user regexes cannot
stall the server; an adapter that can never be paged in is refused, not served forever."""
from __future__ import annotations

import json
import struct
import time
from dataclasses import replace

import httpx
import pytest
import torch

from adapters.format import inspect_adapter_bytes
from server.embedded_redis.server import free_port
from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.hostile_helpers import Victim, nan_like, stream_text, tampered_adapter, victim_body


def _upload_bytes(server, key: str, name: str, config: bytes, weights: bytes) -> httpx.Response:
    files = {"adapter_config.json": ("adapter_config.json", config),
             "adapter_model.safetensors": ("adapter_model.safetensors", weights)}
    with server.http(key) as h:
        return h.post("/v1/adapters", data={"name": name}, files=files)


def _files(d) -> tuple[bytes, bytes]:
    return (d / "adapter_config.json").read_bytes(), (d / "adapter_model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def victim_reference(api_server) -> str:
    _, key = api_server.new_tenant()
    return stream_text(api_server.url, key, victim_body(api_server.state.model_id))[0]


BAD_VALUES = {
    "nan lora_B": dict(lora_b=nan_like),
    "inf lora_B": dict(lora_b=lambda t: torch.full_like(t, float("inf"))),
    "1e38 lora_B": dict(lora_b=lambda t: torch.full_like(t, 1e38)),
    "alpha 1e30": dict(config={"lora_alpha": 1e30}),
    "alpha 1e308": dict(config={"lora_alpha": 1e308}),
    "alpha_pattern 1e308": dict(config={"alpha_pattern": {"q_proj": 1e308}}),
}


@pytest.mark.parametrize("what", list(BAD_VALUES))
def test_poisonous_values_are_refused_at_upload(api_server, tiny_adapters, tmp_path, what):
    _, key = api_server.new_tenant()
    bad = tampered_adapter(tiny_adapters["r8_all"], tmp_path / "bad", **BAD_VALUES[what])
    r = api_server.upload(key, "bad", bad)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter", r.text
    with api_server.http(key) as h:
        assert h.get("/v1/adapters").json()["data"] == []


def test_malformed_adapter_files_are_400(api_server, tiny_adapters):
    _, key = api_server.new_tenant()
    config, weights = _files(tiny_adapters["r4_qv"])
    cfg = json.loads(config)
    deep_config = json.dumps({**cfg, "extra": "X"}).replace('"X"', "[" * 100_000 + "]" * 100_000).encode()
    huge_r = json.dumps(cfg).replace('"r": 4', '"r": ' + "9" * 5000).encode()
    assert b"9" * 5000 in huge_r
    header = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    deep_header = struct.pack("<Q", len(header)) + header
    for what, (c, w) in {"deep config": (deep_config, weights), "huge r": (huge_r, weights),
                         "deep header": (config, deep_header),
                         "surrogate": (config.replace(b'"LORA"', b'"LORA\\ud800"'), weights)}.items():
        r = _upload_bytes(api_server, key, "m", c, w)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter", (what, r.text)


def test_a_stored_poisonous_adapter_fails_only_its_own_requests(api_server, tiny_adapters, tmp_path,
                                                                victim_reference):
    """Stored before validation existed (written straight into the registry): served requests on it
    fail with an error the client sees, while another tenant's stream is unharmed."""
    name, key = api_server.new_tenant()
    _, victim_key = api_server.new_tenant()
    state = api_server.state
    config, weights = _files(tampered_adapter(tiny_adapters["r8_all"], tmp_path / "nan", lora_b=nan_like))
    summary = inspect_adapter_bytes(config, weights, state.engine.info.adapter_shape,
                                    state.config.engine.lora.max_lora_rank)
    state.registry.put(state.tenants.get(name).id, "poison", config, weights, summary=summary)
    body = {"model": "poison", "prompt": "hello", "max_tokens": 8, "temperature": 0}
    model = state.model_id
    with Victim(api_server.url, victim_key, model) as victim, api_server.http(key) as h:
        for _ in range(3):
            start = time.monotonic()
            r = h.post("/v1/completions", json=body)
            assert r.status_code >= 400 and "error" in r.json(), r.text
            assert time.monotonic() - start < 10
    victim.assert_completed(victim_reference)
    assert state.engine.is_healthy
    with api_server.http(victim_key) as h:
        assert h.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_catastrophic_target_regex_cannot_stall_the_server(api_server, tiny_adapters, tmp_path, victim_reference):
    _, key = api_server.new_tenant()
    _, victim_key = api_server.new_tenant()
    src = tiny_adapters["r4_qv"]
    cases = {"target": {"target_modules": "(.|.){0,24}\\.q_proj"},
             "rank_pattern": {"target_modules": ["q_proj", "v_proj"], "rank_pattern": {"(.|.){0,24}\\.q_proj": 4}},
             "exclude": {"target_modules": ["q_proj", "v_proj"], "exclude_modules": "(.|.){0,24}\\.k_proj"}}
    with Victim(api_server.url, victim_key, api_server.state.model_id) as victim:
        for what, config in cases.items():
            start = time.monotonic()
            r = api_server.upload(key, what.replace("_", "-"), tampered_adapter(src, tmp_path / what, config=config))
            assert time.monotonic() - start < 10, what
            assert r.status_code in (201, 400), r.text
            if r.status_code == 201:
                # What was stored names the modules: a later load never runs the pattern again.
                stored, _ = api_server.state.registry.read_files(r.json()["version"])
                assert "(.|.)" not in stored.decode()
    victim.assert_completed(victim_reference)


def test_adapter_larger_than_the_host_budget(tiny_model_dir, tiny_adapters, redis_server, tmp_path, core_starter):
    r4_bytes = 4 * 4 * 2 * (64 + 64 + 64 + 32)  # rank 4, q and v, 2 layers, as float32
    config = server_config(tiny_model_dir, tmp_path, api_redis_url(redis_server), port=free_port(),
                           max_cpu_lora_bytes=r4_bytes)
    with running_server(replace(config), starter=core_starter) as server:
        name, key = server.new_tenant()
        assert server.upload(key, "small", tiny_adapters["r4_qv"]).status_code == 201
        r = server.upload(key, "big", tiny_adapters["r8_all"])
        assert r.status_code == 413 and "--max-cpu-lora-bytes" in r.json()["error"]["message"], r.text
        # One stored anyway (e.g. before the budget was lowered) fails fast, without spinning.
        state = server.state
        config_json, weights = _files(tiny_adapters["r8_all"])
        summary = inspect_adapter_bytes(config_json, weights, state.engine.info.adapter_shape,
                                        state.config.engine.lora.max_lora_rank)
        state.registry.put(state.tenants.get(name).id, "big", config_json, weights, summary=summary)
        misses = state.engine.stats().host.misses
        with server.http(key) as h:
            start = time.monotonic()
            r = h.post("/v1/completions", json={"model": "big", "prompt": "hi", "max_tokens": 2})
            assert r.status_code >= 400 and "budget" in r.json()["error"]["message"], r.text
            assert time.monotonic() - start < 10
            time.sleep(0.5)
            assert state.engine.stats().host.misses - misses <= 2  # no reload loop
            ok = h.post("/v1/completions", json={"model": "small", "prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200
