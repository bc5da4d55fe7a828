"""Speculative decoding over HTTP: the per-request opt-out (`speculative: false`, same text, no drafts),
and vLLM's spec_decode counters in /metrics and /admin/engine equal to the engine's own.
Real redis, uvicorn and the openai client."""
from __future__ import annotations

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.server.engine.test_speculative_ngram import looping, repetitive_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": 64}


def test_opt_out_and_the_spec_decode_counters(tmp_path, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server),
                           speculative_config=json.dumps(SPEC))
    prompt = repetitive_prompts(1, seed=21)[0]
    body = {"ignore_eos": True, "logit_bias": {str(t): b for t, b in looping(prompt).items()}}
    with running_server(config, starter=core_starter) as server:
        _, key = server.new_tenant()
        client, model = server.client(key), server.state.model_id

        def complete(**extra) -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                             extra_body={**body, **extra}).choices[0].text

        plain = complete(speculative=False)
        assert server.state.engine.stats().speculative.num_drafts == 0
        assert complete() == plain
        with pytest.raises(openai.BadRequestError) as e:
            complete(speculative="sometimes")
        assert e.value.body["param"] == "speculative"
        stats = server.state.engine.stats().speculative  # idle now: nothing moves
        metrics = {f.name: f for f in text_string_to_metric_families(server.admin("GET", "/metrics").text)}
        view = server.admin("GET", "/admin/engine").json()["speculative_decoding"]
    assert stats.method == "ngram" and stats.num_accepted_tokens > 0

    def value(name: str, **labels) -> float:
        [sample] = [s for s in metrics[name].samples
                    if s.name == f"{name}_total" and s.labels == {"model_name": model, **labels}]
        return sample.value

    assert value("vllm:spec_decode_num_drafts") == stats.num_drafts
    assert value("vllm:spec_decode_num_draft_tokens") == stats.num_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens") == stats.num_accepted_tokens
    assert [value("vllm:spec_decode_num_accepted_tokens_per_pos", position=str(j))
            for j in range(len(stats.accepted_per_position))] == list(stats.accepted_per_position)
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert view == {"method": "ngram", "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                    "num_accepted_tokens": stats.num_accepted_tokens,
                    "accepted_per_position": list(stats.accepted_per_position),
                    "acceptance_rate": pytest.approx(stats.num_accepted_tokens / stats.num_draft_tokens),
                    "mean_accepted_length": pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts),
                    "skipped_steps": 0}
