"""DoRA adapters over HTTP: an upload is served as PEFT serves it; a hostile DoRA file (magnitude
vectors of the wrong shape, non-finite or beyond float16, or missing) is refused at upload with a 400
that says why, and nothing is stored."""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

PROMPT = "The quick brown fox"
Q0_M = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"


def _tampered(src, dst, change):
    """A copy of the DoRA adapter in `src` whose tensors are `change(tensors)`."""
    dst.mkdir(parents=True)
    (dst / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    tensors = safetensors.torch.load_file(str(src / "adapter_model.safetensors"))
    safetensors.torch.save_file(change(tensors), str(dst / "adapter_model.safetensors"))
    return dst


def test_a_dora_upload_is_served_as_peft_serves_it(api_server, tiny_model_dir, tiny_dora_adapters, peft_oracle):
    _, key = api_server.new_tenant()
    path = tiny_dora_adapters["dora_r16_pattern"]
    r = api_server.upload(key, "dora", path)
    assert r.status_code == 201, r.text
    tensors = safetensors.torch.load_file(str(path / "adapter_model.safetensors"))
    assert r.json()["size_bytes"] == 4 * sum(t.numel() for t in tensors.values())  # magnitudes counted
    completion = api_server.client(key).completions.create(model="dora", prompt=PROMPT, max_tokens=6, temperature=0,
                                                           extra_body={"ignore_eos": True})
    tok = api_server.state.engine.engine.tokenizer
    assert completion.choices[0].text == tok.decode(peft_oracle(tiny_model_dir, path, tok(PROMPT).input_ids, 6))
    # Its scales against this server's base now live in the server's Redis beside the version.
    prefix, version = api_server.state.config.redis_prefix, r.json()["version"]
    assert api_server.state.redis.hkeys(f"{prefix}ad:dora:{version}") == [
        api_server.state.engine.engine.slots.dora_cache.base.encode()]
    scales = api_server.admin("GET", "/admin/engine").json()["dora_scales"]
    assert scales["computed"] >= 1 and scales["stored"] >= 1 and scales["refused"] == 0


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
