"""`loraplex serve --tensor-parallel-size 2 --engine-process separate`: the engine core spawns its gloo
worker and serves, over HTTP, the text the one-process engine generates: base rows, a LoRA adapter and a
DoRA one (its scales computed at upload against the full weights, kept in Redis)."""
from __future__ import annotations

import pytest

from server.engine import LLM, SamplingParams
from tests.fixtures_server import api_redis_url, running_server, server_config

PROMPTS = ([5, 17, 99, 23, 41], [7, 8, 300, 12])


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, tiny_model_dir, tiny_adapters, tiny_dora_adapters, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("tp-data"), api_redis_url(redis_server))
    config = config.with_settings(engine_process="separate", tensor_parallel_size=2, redis_prefix="lp-tp:",
                                  served_model_name="tiny-base")
    with running_server(config, starter=core_starter) as handle:
        _, key = handle.new_tenant()
        assert handle.upload(key, "r8_all", tiny_adapters["r8_all"]).status_code == 201
        assert handle.upload(key, "dora_r8_all", tiny_dora_adapters["dora_r8_all"]).status_code == 201
        yield handle, key


def test_completions_equal_one_process_engine(tp_server, tiny_model_dir, tiny_adapters, tiny_dora_adapters):
    handle, key = tp_server
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_loras=4, max_lora_rank=32, kv_cache_blocks=64)
    llm.add_adapter("r8_all", tiny_adapters["r8_all"])
    llm.add_adapter("dora_r8_all", tiny_dora_adapters["dora_r8_all"])
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    with handle.http(key) as http:
        for model, adapter in (("tiny-base", None), ("r8_all", "r8_all"), ("dora_r8_all", "dora_r8_all")):
            want = [o.text for o in llm.generate(list(PROMPTS), params, adapters=[adapter] * len(PROMPTS))]
            for prompt, text in zip(PROMPTS, want):
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "model": model}
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == text, model
