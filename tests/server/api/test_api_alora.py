"""Activated LoRA over HTTP: an uploaded aLoRA serves PEFT's tokens and shares the prompt's base-model
blocks with a second aLoRA; a malformed alora_invocation_tokens is a 400 that names the field."""
from __future__ import annotations

import pytest

from tests.hostile_helpers import tampered_adapter
from tests.server.engine.lora.test_engine_alora import INV_A, words


def _complete(server, key: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with server.http(key) as h:
        r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_uploaded_aloras_match_peft_and_share_the_prompt(api_server, tiny_model_dir, tiny_adapters, peft_oracle,
                                                         tmp_path):
    _, key = api_server.new_tenant()
    dirs = {name: tampered_adapter(tiny_adapters[src], tmp_path / name, config={"alora_invocation_tokens": INV_A})
            for name, src in (("judge", "r8_all"), ("critic", "r16_rslora"))}
    for name, d in dirs.items():
        r = api_server.upload(key, name, d)
        assert r.status_code == 201, r.text
    tok = api_server.tokenizer
    block = api_server.state.engine.info.block_size
    prompt = words(64, 50) + INV_A  # the invocation at the end, as a caller appends it
    cached = []
    for name, d in dirs.items():
        out = _complete(api_server, key, name, prompt)
        assert out["choices"][0]["text"] == tok.decode(peft_oracle(tiny_model_dir, d, prompt, 5))
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    # The second aLoRA found the prompt's blocks before the invocation, computed by the first.
    assert cached == [0, 64 // block * block]
    # Without the invocation the adapter never applies: the base model's answer.
    plain = words(40, 51)
    assert _complete(api_server, key, "judge", plain)["choices"][0]["text"] == \
        tok.decode(peft_oracle(tiny_model_dir, None, plain, 5))


@pytest.mark.parametrize("value, why", [
    ("7 8 9", "list of token ids"),
    ([7, "8"], "list of token ids"),
    ([7.0], "list of token ids"),
    ([True], "list of token ids"),
    ([[7]], "list of token ids"),
    ([], "empty"),
    ([7] * 129, "at most 128"),
    ([7, 512], "outside the base model's vocabulary of 512"),
    ([-1], "-1, which is not a token id"),
    ([2**40], "not a token id"),
], ids=["string", "mixed", "float", "bool", "nested", "empty", "too-long", "out-of-vocab", "negative", "huge"])
def test_malformed_invocation_tokens_are_400(api_server, tiny_adapters, tmp_path, value, why):
    _, key = api_server.new_tenant()
    bad = tampered_adapter(tiny_adapters["r4_qv"], tmp_path / "bad", config={"alora_invocation_tokens": value})
    r = api_server.upload(key, "bad", bad)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_adapter" and error["param"] == "alora_invocation_tokens", error
    assert why in error["message"] and "alora_invocation_tokens" in error["message"], error
    with api_server.http(key) as h:
        assert h.get("/v1/adapters").json()["data"] == []
