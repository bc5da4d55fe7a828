"""Speculative decoding over HTTP: the per-request opt-out (`speculative: false`, same text, no drafts),
and vLLM's spec_decode counters in /metrics and /admin/engine equal to the engine's own.
Real redis, uvicorn and the openai client."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.server.engine.test_speculative_ngram import looping, repetitive_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": 64}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                                     "minItems": 2, "maxItems": 6}},
          "required": ["items"], "additionalProperties": False}


@contextlib.contextmanager
def speculative_server(spec: dict, tmp_path, model_dir, redis_server, core_starter) -> Iterator[tuple]:
    """(server, a fresh tenant's openai client, the model id) of a real server running `spec`."""
    config = server_config(model_dir, tmp_path / "data", api_redis_url(redis_server),
                           speculative_config=json.dumps(spec))
    with running_server(config, starter=core_starter) as server:
        _, key = server.new_tenant()
        yield server, server.client(key), server.state.model_id


def looping_request(seed: int) -> tuple[list[int], dict]:
    """A repetitive prompt and the request fields (a logit bias toward its loop) that make prompt lookup's
    drafts accepted."""
    prompt = repetitive_prompts(1, seed=seed)[0]
    return prompt, {"ignore_eos": True, "logit_bias": {str(t): b for t, b in looping(prompt).items()}}


def json_answer(client: openai.OpenAI, model: str, **extra) -> str:
    """A greedy chat answer under SCHEMA (response_format json_schema)."""
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "list"}], max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "items", "schema": SCHEMA}},
        extra_body=extra).choices[0].message.content


def test_opt_out_and_the_spec_decode_counters(tmp_path, tiny_model_dir, redis_server, core_starter):
    prompt, body = looping_request(seed=21)
    with speculative_server(SPEC, tmp_path, tiny_model_dir, redis_server, core_starter) as (server, client, model):

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


def test_streams_stops_and_constrained_answers_over_http_are_the_plain_engines(tmp_path, tiny_model_dir,
                                                                                redis_server, core_starter):
    """With drafts accepted, a step emits several tokens: streamed chunks join to the non-streamed text,
    a stop string inside an accepted run cuts both where the plain engine stops, and a JSON-schema answer
    (each verify position under its own mask) is the one without speculation, and valid."""
    prompt, body = looping_request(seed=23)
    with speculative_server(SPEC, tmp_path, tiny_model_dir, redis_server, core_starter) as (server, client, model):

        def complete(stream: bool = False, **extra):
            kw = dict(model=model, prompt=prompt, max_tokens=30, temperature=0, logprobs=1,
                      extra_body={**body, **extra})
            if not stream:
                choice = client.completions.create(**kw).choices[0]
                return choice.text, choice.finish_reason, choice.logprobs.tokens
            text, tokens, reason = "", [], None
            for chunk in client.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    text += c.text
                    tokens += c.logprobs.tokens if c.logprobs else []
                    reason = c.finish_reason or reason
            return text, reason, tokens

        plain = complete(speculative=False)
        accepted = server.state.engine.stats().speculative.num_accepted_tokens
        assert complete() == plain and complete(stream=True) == plain
        assert server.state.engine.stats().speculative.num_accepted_tokens > accepted, "no run of drafts streamed"
        stop = plain[0][len(plain[0]) // 2:][:3]
        cut = complete(speculative=False, stop=[stop])
        assert cut[1] == "stop" and stop not in cut[0] and plain[0].startswith(cut[0])
        assert complete(stop=[stop]) == cut and complete(stream=True, stop=[stop]) == cut

        answer = json_answer(client, model, speculative=False)
        drafts = server.state.engine.stats().speculative.num_draft_tokens
        assert json_answer(client, model) == answer
        assert server.state.engine.stats().speculative.num_draft_tokens > drafts
    assert set(json.loads(answer)["items"]) <= {"ab", "cd"}


def test_a_draft_models_constrained_answer_over_http_is_the_plain_engines(tmp_path, tiny_model_dir, redis_server,
                                                                           core_starter):
    """A draft model's drafts for a JSON-schema answer are checked by the grammar inside the step: drafts are
    verified and accepted, and the answer is the one without speculation, and valid."""
    spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}
    with speculative_server(spec, tmp_path, tiny_model_dir, redis_server, core_starter) as (server, client, model):

        answer = json_answer(client, model, speculative=False)
        before = server.state.engine.stats().speculative
        assert json_answer(client, model) == answer
        after = server.state.engine.stats().speculative
        assert after.num_draft_tokens > before.num_draft_tokens
        assert after.num_accepted_tokens > before.num_accepted_tokens
    assert set(json.loads(answer)["items"]) <= {"ab", "cd"}
