"""Adapter upload and serving: per-tenant names, PEFT-exact outputs, isolation,
replace/delete, and refusal of bad uploads with nothing left in Redis."""
from __future__ import annotations

import asyncio
import io
import json

import pytest
import torch
from safetensors.torch import save


PROMPT = "Once upon a time"


def _greedy(server, key, model, n=8) -> str:
    r = server.client(key).completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0,
                                              extra_body={"ignore_eos": True})
    return r.choices[0].text


def _expected(server, tiny_model_dir, adapter_dir, peft_oracle, n=8) -> str:
    tok = server.tokenizer
    return tok.decode(peft_oracle(tiny_model_dir, adapter_dir, tok(PROMPT).input_ids, n))


def test_two_tenants_same_name_each_get_their_own(api_server, tiny_model_dir, tiny_adapters, peft_oracle):
    a_name, a_key = api_server.new_tenant()
    b_name, b_key = api_server.new_tenant()
    ra = api_server.upload(a_key, "mine", tiny_adapters["r4_qv"])
    rb = api_server.upload(b_key, "mine", tiny_adapters["r8_all"])
    assert ra.status_code == 201 and rb.status_code == 201, (ra.text, rb.text)
    assert set(ra.json()) >= {"id", "name", "version", "rank", "target_modules", "size_bytes"}
    assert (ra.json()["rank"], rb.json()["rank"]) == (4, 8)
    out_a, out_b = _greedy(api_server, a_key, "mine"), _greedy(api_server, b_key, "mine")
    assert out_a == _expected(api_server, tiny_model_dir, tiny_adapters["r4_qv"], peft_oracle)
    assert out_b == _expected(api_server, tiny_model_dir, tiny_adapters["r8_all"], peft_oracle)
    assert out_a != out_b
    base = _greedy(api_server, a_key, api_server.state.model_id)
    assert base == _expected(api_server, tiny_model_dir, None, peft_oracle)

    # A third tenant sees neither: not listed, not callable, not deletable, and not replaceable
    # (its own upload of "mine" is a new adapter, not a replacement of someone else's).
    c_name, c_key = api_server.new_tenant()
    assert [m.id for m in api_server.client(c_key).models.list().data] == [api_server.state.model_id]
    with api_server.http(c_key) as h:
        assert h.get("/v1/adapters").json()["data"] == []
        assert h.get("/v1/adapters/mine").status_code == 404
        assert h.delete("/v1/adapters/mine").status_code == 404
        r = h.post("/v1/completions", json={"model": "mine", "prompt": "x"})
        assert r.status_code == 404 and "mine" in r.json()["error"]["message"]
        assert "tenant" not in r.json()["error"]["message"]
    assert api_server.upload(c_key, "mine", tiny_adapters["r16_rslora"], replace=True).status_code == 201
    assert _greedy(api_server, a_key, "mine") == out_a
    assert _greedy(api_server, b_key, "mine") == out_b

    # B's listing shows only its own adapter; a tenant's models list has parent = base
    with api_server.http(b_key) as h:
        names = [(d["name"], d["rank"]) for d in h.get("/v1/adapters").json()["data"]]
    assert names == [("mine", 8)]
    models = api_server.client(a_key).models.list().data
    assert [(m.id, m.parent) for m in models] == [(api_server.state.model_id, None),
                                                  ("mine", api_server.state.model_id)]


def test_replace_and_delete(api_server, tiny_model_dir, tiny_adapters, peft_oracle):
    _, key = api_server.new_tenant()
    first = api_server.upload(key, "ad", tiny_adapters["r4_qv"]).json()
    out_first = _greedy(api_server, key, "ad")
    dup = api_server.upload(key, "ad", tiny_adapters["r8_all"])
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "adapter_exists"
    second = api_server.upload(key, "ad", tiny_adapters["r8_all"], replace=True)
    assert second.status_code == 201 and second.json()["version"] != first["version"]
    out_second = _greedy(api_server, key, "ad")
    assert out_second == _expected(api_server, tiny_model_dir, tiny_adapters["r8_all"], peft_oracle)
    assert out_second != out_first
    assert not asyncio.run(api_server.state.engine.has_adapter(first["version"]))  # left the host tier
    with api_server.http(key) as h:
        assert h.get("/v1/adapters/ad").json()["version"] == second.json()["version"]
        assert h.delete("/v1/adapters/ad").status_code == 200
        assert h.get("/v1/adapters/ad").status_code == 404
        assert h.post("/v1/completions", json={"model": "ad", "prompt": "x"}).status_code == 404
    assert not asyncio.run(api_server.state.engine.has_adapter(second.json()["version"]))


def _index_keys(server, tenant: str) -> int:
    r = server.state.redis
    return r.hlen(f"{server.config.redis_prefix}ad:idx:{tenant}")


def _upload_bytes(server, key, name, config: bytes, weights: bytes, weights_name="adapter_model.safetensors"):
    files = {"adapter_config.json": ("adapter_config.json", config), weights_name: (weights_name, weights)}
    with server.http(key) as h:
        return h.post("/v1/adapters", data={"name": name}, files=files)


def _all_keys(server) -> set[bytes]:
    return set(server.state.redis.keys(f"{server.config.redis_prefix}ad:*"))


@pytest.mark.parametrize("case", ["pickle", "truncated", "mismatch", "not_multipart", "missing_file"])
def test_bad_uploads_are_refused_and_leave_nothing(api_server, tiny_adapters, case):
    tenant, key = api_server.new_tenant()
    d = tiny_adapters["r8_all"]
    config = (d / "adapter_config.json").read_bytes()
    weights = (d / "adapter_model.safetensors").read_bytes()
    before = _all_keys(api_server)
    if case == "pickle":
        buf = io.BytesIO()
        torch.save({"x": torch.zeros(2)}, buf)
        r = _upload_bytes(api_server, key, "bad", config, buf.getvalue(), weights_name="adapter_model.bin")
        assert r.status_code == 400
        r2 = _upload_bytes(api_server, key, "bad", config, buf.getvalue())  # pickle bytes, right name
        assert r2.status_code == 400 and r2.json()["error"]["code"] == "invalid_adapter"
    elif case == "truncated":
        r = _upload_bytes(api_server, key, "bad", config, weights[: len(weights) // 2])
        assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
    elif case == "mismatch":
        cfg = json.loads(config)
        cfg["r"] = 4  # the tensors are rank 8
        r = _upload_bytes(api_server, key, "bad", json.dumps(cfg).encode(), weights)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"
    elif case == "not_multipart":
        with api_server.http(key) as h:
            r = h.post("/v1/adapters", data={"name": "bad"})  # form-urlencoded: no files
        assert r.status_code == 400
        with api_server.http(key) as h:  # JSON registers by reference, and needs a source
            r = h.post("/v1/adapters", json={"name": "bad"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "source"
    else:
        with api_server.http(key) as h:
            r = h.post("/v1/adapters", data={"name": "bad"},
                       files={"adapter_config.json": ("adapter_config.json", config)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "adapter_model.safetensors"
    assert set(r.json()) == {"error"}
    assert _index_keys(api_server, tenant) == 0
    assert _all_keys(api_server) == before


def test_tensor_shapes_that_do_not_fit_the_model_are_refused(api_server, tiny_adapters):
    _, key = api_server.new_tenant()
    d = tiny_adapters["r4_qv"]
    weights = save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 7),
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)})
    r = _upload_bytes(api_server, key, "bad", (d / "adapter_config.json").read_bytes(), weights)
    assert r.status_code == 400 and "shape" in r.json()["error"]["message"], r.text
