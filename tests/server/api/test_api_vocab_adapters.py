"""Uploads of adapters with parts of embed_tokens and lm_head through the real server: served as PEFT serves
them, and the refusals (a saved module other than those two, a resized vocabulary, parts above
--max-lora-vocab-bytes) are 400s that name what is wrong and leave nothing stored."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.vocab_adapters import make_vocab_adapter

PROMPT = "Once upon a time"
COPY_BYTES = 4 * 512 * 64  # one full embedding of the tiny model, float32


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("vocab-api"), api_redis_url(redis_server),
                           max_lora_vocab_bytes=COPY_BYTES + 16384)  # one copy and a LoRA
    with running_server(config, starter=core_starter) as handle:
        yield handle


def test_a_saved_embedding_and_an_lm_head_lora_are_served_as_peft(server, tmp_path, tiny_model_dir, peft_oracle):
    _, key = server.new_tenant()
    saved = make_vocab_adapter(tiny_model_dir, tmp_path / "saved", target_modules=["q_proj"],
                               modules_to_save=["embed_tokens"], seed=3)
    head = make_vocab_adapter(tiny_model_dir, tmp_path / "head", target_modules=["v_proj", "lm_head"], seed=4)
    for name, path in (("saved", saved), ("head", head)):
        r = server.upload(key, name, path)
        assert r.status_code == 201, r.text
    assert r.json()["target_modules"] == ["lm_head", "v_proj"]
    tok = server.tokenizer
    ids = tok(PROMPT).input_ids
    for name, path in (("saved", saved), ("head", head), (server.state.model_id, None)):
        out = server.client(key).completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                                                    extra_body={"ignore_eos": True})
        assert out.choices[0].text == tok.decode(peft_oracle(tiny_model_dir, path, ids, 8)), name


def test_refusals_name_what_is_wrong_and_store_nothing(server, tmp_path, tiny_model_dir):
    _, key = server.new_tenant()
    before = set(server.state.redis.keys(f"{server.config.redis_prefix}ad:*"))
    both = make_vocab_adapter(tiny_model_dir, tmp_path / "both", target_modules=["q_proj"],
                              modules_to_save=["embed_tokens", "lm_head"], seed=5)
    grown = make_vocab_adapter(tiny_model_dir, tmp_path / "grown", target_modules=["q_proj"],
                               modules_to_save=["embed_tokens", "lm_head"], resize_vocab=520, seed=6)
    norm = Path(shutil.copytree(both, tmp_path / "norm"))
    config = json.loads((norm / "adapter_config.json").read_text())
    (norm / "adapter_config.json").write_text(json.dumps(config | {"modules_to_save": ["embed_tokens", "norm"]}))
    cases = [
        (both, None, rf"take {2 * COPY_BYTES} bytes .*--max-lora-vocab-bytes"),
        (norm, "modules_to_save", "modules_to_save entry 'norm' selects model.norm"),
        (grown, None, "has a vocabulary of 520 rows but the base model's is 512"),
    ]
    for path, param, message in cases:
        r = server.upload(key, "bad", path)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_adapter"
        assert re.search(message, error["message"]), error["message"]
        if param is not None:
            assert error["param"] == param
    assert set(server.state.redis.keys(f"{server.config.redis_prefix}ad:*")) == before
    with server.http(key) as h:
        assert h.get("/v1/adapters").json()["data"] == []
