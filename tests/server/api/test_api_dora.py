"""DoRA adapters over HTTP: an upload (or a preload) is served as PEFT serves it, its scales computed
and stored in Redis before it is answered, so its first request reads them; a hostile DoRA file (magnitude
vectors of the wrong shape, non-finite or beyond float16, or missing) is refused at upload with a 400
that says why, and nothing is stored."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import safetensors.torch
import torch

from server.embedded_redis.server import EmbeddedRedis
from tests.fixtures_server import free_port, running_server, server_config

PROMPT = "The quick brown fox"
Q0_M = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"


def _tampered(src, dst, change):
    """A copy of the DoRA adapter in `src` whose tensors are `change(tensors)`."""
    dst.mkdir(parents=True)
    (dst / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    tensors = safetensors.torch.load_file(str(src / "adapter_model.safetensors"))
    safetensors.torch.save_file(change(tensors), str(dst / "adapter_model.safetensors"))
    return dst


def _scale_counts(server) -> dict[str, int]:
    return server.admin("GET", "/admin/engine").json()["dora_scales"]


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("computed", "precomputed", "read", "stored", "refused")}


def _served_base(server) -> bytes:
    """The served weights' identity, as the engine computed it for its first DoRA adapter (an engine
    core publishes it with its next snapshot, within 0.25 s)."""
    deadline = time.monotonic() + 5
    while server.state.engine.snapshot().dora_base is None:
        assert time.monotonic() < deadline, "no DoRA base identity published"
        time.sleep(0.05)
    return server.state.engine.snapshot().dora_base.encode()


def _stored_bases(server, version: str) -> list[bytes]:
    return server.state.redis.hkeys(f"{server.state.config.redis_prefix}ad:dora:{version}")


def test_a_dora_upload_is_served_as_peft_serves_it(api_server, tiny_model_dir, tiny_dora_adapters, peft_oracle):
    """The upload's answer comes once its scales against this server's base are in Redis beside the
    version; the first request for it reads them (computes none) and serves as PEFT does."""
    _, key = api_server.new_tenant()
    path = tiny_dora_adapters["dora_r16_pattern"]
    before = _scale_counts(api_server)
    r = api_server.upload(key, "dora", path)
    assert r.status_code == 201, r.text
    tensors = safetensors.torch.load_file(str(path / "adapter_model.safetensors"))
    assert r.json()["size_bytes"] == 4 * sum(t.numel() for t in tensors.values())  # magnitudes counted
    uploaded = _scale_counts(api_server)
    assert _delta(uploaded, before) == {"computed": 1, "precomputed": 1, "read": 0, "stored": 1, "refused": 0}
    assert _stored_bases(api_server, r.json()["version"]) == [
        _served_base(api_server)]
    completion = api_server.client(key).completions.create(model="dora", prompt=PROMPT, max_tokens=6, temperature=0,
                                                           extra_body={"ignore_eos": True})
    tok = api_server.tokenizer
    assert completion.choices[0].text == tok.decode(peft_oracle(tiny_model_dir, path, tok(PROMPT).input_ids, 6),
                                                                skip_special_tokens=True)
    assert _delta(_scale_counts(api_server), uploaded) == {
        "computed": 0, "precomputed": 0, "read": 1, "stored": 0, "refused": 0}


def test_a_preloaded_dora_adapter_is_reloaded_at_its_first_request(tiny_model_dir, tiny_dora_adapters, peft_oracle,
                                                                   tmp_path, core_starter):
    """--adapter: the scales are computed at start-up, before serving; a restart finds them in Redis and
    computes nothing; the first request reads them and serves as PEFT does."""
    path = tiny_dora_adapters["dora_r8_all"]
    with EmbeddedRedis.start(tmp_path / "redis") as redis_server:
        config = server_config(tiny_model_dir, tmp_path / "data", redis_server.url_for(1),
                               adapters=(("acme", "pre", str(path)),))
        with running_server(config, starter=core_starter) as server:
            started = _scale_counts(server)
            assert (started["computed"], started["precomputed"], started["stored"]) == (1, 1, 1)
            version = server.state.registry.get(server.state.tenants.get("acme").id, "pre").version
            assert _stored_bases(server, version) == [_served_base(server)]
        with running_server(replace(config, port=free_port()), starter=core_starter) as server:
            assert _scale_counts(server)["computed"] == 0  # found in Redis at start-up
            _, key = server.state.tenants.create_key("acme")
            completion = server.client(key).completions.create(model="pre", prompt=PROMPT, max_tokens=6,
                                                               temperature=0, extra_body={"ignore_eos": True})
            tok = server.tokenizer
            assert completion.choices[0].text == tok.decode(peft_oracle(tiny_model_dir, path, tok(PROMPT).input_ids, 6),
                                                                skip_special_tokens=True)
            counts = _scale_counts(server)
            assert (counts["computed"], counts["read"]) == (0, 1)


HOSTILE = {
    "lora_magnitude_vector has shape [65], must be [64]": lambda t: t | {Q0_M: torch.ones(65)},
    "lora_magnitude_vector has shape [1]": lambda t: t | {Q0_M: torch.ones(1)},
    "need 1 dimension": lambda t: t | {Q0_M: torch.ones(64, 64)},
    "lora_magnitude_vector holds nan": lambda t: t | {Q0_M: torch.full((64,), float("nan"))},
    "lora_magnitude_vector holds inf": lambda t: t | {Q0_M: torch.full((64,), float("inf"))},
    "beyond 65504": lambda t: t | {Q0_M: torch.full((64,), 1e30)},
    "has no lora_magnitude_vector": lambda t: {k: v for k, v in t.items() if k != Q0_M},
}


@pytest.mark.parametrize("reason", list(HOSTILE))
def test_a_hostile_dora_file_is_refused_at_upload(api_server, tiny_dora_adapters, tmp_path, reason):
    _, key = api_server.new_tenant()
    bad = _tampered(tiny_dora_adapters["dora_r8_all"], tmp_path / "bad", HOSTILE[reason])
    r = api_server.upload(key, "bad", bad)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_adapter" and reason in error["message"], error
    with api_server.http(key) as h:
        assert h.get("/v1/adapters").json()["data"] == []


def test_use_dora_must_be_a_boolean(api_server, tiny_dora_adapters, tmp_path):
    _, key = api_server.new_tenant()
    src = tiny_dora_adapters["dora_r4_qv"]
    bad = _tampered(src, tmp_path / "bad", lambda t: t)
    cfg = json.loads((src / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": "true"}))
    r = api_server.upload(key, "bad", bad)
    assert r.status_code == 400 and "use_dora must be true or false" in r.json()["error"]["message"], r.text
