"""Each architecture beyond the Llama family served over HTTP: an uploaded PEFT adapter's and the base
model's greedy completions are transformers + peft's."""
from __future__ import annotations

import pytest

from tests.fixtures_architectures import ARCH_MODELS
from tests.fixtures_server import api_redis_url, running_server, server_config

PROMPT = "Once upon a time"


@pytest.mark.parametrize("model", sorted(ARCH_MODELS))
def test_completions_match_peft(model, arch_model, tmp_path, redis_server, peft_oracle, core_starter):
    from transformers import AutoTokenizer

    model_dir, adapters = arch_model(model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(PROMPT).input_ids
    with running_server(server_config(model_dir, tmp_path / "data", api_redis_url(redis_server)),
                        starter=core_starter) as server:
        _, key = server.new_tenant()
        assert server.upload(key, "a", adapters["dora_r16"]).status_code == 201
        client = server.client(key)
        for name, adapter_dir in (("a", adapters["dora_r16"]), (server.state.model_id, None)):
            out = client.completions.create(model=name, prompt=PROMPT, max_tokens=5, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            expected = tok.decode(peft_oracle(model_dir, adapter_dir, ids, 5), skip_special_tokens=True)
            assert out.choices[0].text == expected
