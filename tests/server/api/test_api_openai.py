"""OpenAI endpoints through the `openai` client against a real uvicorn: outputs match
transformers greedy, streaming equals non-streaming, usage is exact, errors are
OpenAI-shaped with the right status."""
from __future__ import annotations

import httpx
import openai
import pytest


PROMPT = "The quick brown fox"


def _ids(server, text: str) -> list[int]:
    return server.tokenizer(text).input_ids


def test_models_lists_the_base_model(api_server):
    _, key = api_server.new_tenant()
    models = api_server.client(key).models.list()
    assert [m.id for m in models.data] == [api_server.state.model_id]


def test_completion_matches_transformers_greedy(api_server, tiny_model_dir, peft_oracle):
    _, key = api_server.new_tenant()
    r = api_server.client(key).completions.create(
        model=api_server.state.model_id, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    ids = _ids(api_server, PROMPT)
    expected = peft_oracle(tiny_model_dir, None, ids, 12)
    tok = api_server.tokenizer
    assert r.choices[0].text == tok.decode(expected)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)


def test_token_id_prompt_equals_text_prompt(api_server):
    _, key = api_server.new_tenant()
    c = api_server.client(key)
    ids = _ids(api_server, PROMPT)
    a = c.completions.create(model=api_server.state.model_id, prompt=PROMPT, max_tokens=6, temperature=0)
    b = c.completions.create(model=api_server.state.model_id, prompt=ids, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert b.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_non_stream_with_exact_usage(api_server, chat):
    _, key = api_server.new_tenant()
    c = api_server.client(key)
    model = api_server.state.model_id
    if chat:
        kw = dict(model=model, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=10,
                  temperature=0)
        full = c.chat.completions.create(**kw)
        text = full.choices[0].message.content
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        kw = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
        full = c.completions.create(**kw)
        text = full.choices[0].text
        chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == text
    # the usage chunk comes last, with no choices; every other chunk has usage null
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    # The same counts (the second request may find the first's prompt blocks in the prefix cache).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(chunks[-1].usage, k) for k in counts] == [getattr(full.usage, k) for k in counts]
    assert [ch.choices[0].finish_reason for ch in chunks[:-1] if ch.choices[0].finish_reason] == [
        full.choices[0].finish_reason]


def test_raw_stream_ends_with_done(api_server):
    _, key = api_server.new_tenant()
    with api_server.http(key) as h:
        r = h.post("/v1/completions", json={"model": api_server.state.model_id, "prompt": "hi",
                                             "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert '"usage"' not in r.text  # only with stream_options.include_usage


def test_chat_uses_the_tokenizers_template(api_server):
    _, key = api_server.new_tenant()
    msgs = [{"role": "user", "content": "hello there"}]
    r = api_server.client(key).chat.completions.create(model=api_server.state.model_id, messages=msgs,
                                                       max_tokens=2, temperature=0)
    tok = api_server.tokenizer
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_errors_are_openai_shaped(api_server):
    _, key = api_server.new_tenant()
    model = api_server.state.model_id
    with api_server.http(key) as h:
        _error(h.post("/v1/completions", content=b"{not json"), 400)
        _error(h.post("/v1/completions", json=[1, 2]), 400)
        # every validation error is a 400 naming the field in `param` (OpenAI's and vLLM's status)
        assert _error(h.post("/v1/completions", json={"prompt": "x"}), 400)["param"] == "model"
        assert _error(h.post("/v1/completions", json={"model": model, "prompt": 5}), 400)["param"] == "prompt"
        assert _error(h.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": "many"}),
                      400)["param"] == "max_tokens"
        # known fields we cannot honour are a 400 that names them
        for field, value in (("best_of", 3), ("suffix", "x"), ("use_beam_search", True),
                             ("response_format", {"type": "xml"}), ("max_completion_tokens", 3)):
            err = _error(h.post("/v1/completions", json={"model": model, "prompt": "x", field: value}), 400)
            assert field in err["message"] and err["param"].startswith(field)
        _error(h.post("/v1/completions", json={"model": model, "prompt": "x", "temperature": 9}), 400)
        _error(h.post("/v1/completions", json={"model": model, "prompt": [99999]}), 400)
        err = _error(h.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 600}), 400)
        assert "context length" in err["message"]
        err = _error(h.post("/v1/chat/completions", json={"model": model, "messages": []}), 400)
        assert err["param"] == "messages" and "empty" in err["message"]
        _error(h.post("/v1/chat/completions", json={"model": model,
                                                    "messages": [{"role": "tool", "content": "x"}]}), 400)
        _error(h.post("/v1/completions", json={"model": "no-such-adapter", "prompt": "x"}), 404)
        _error(h.get("/v1/nothing-here"), 404)
    with api_server.http() as anon:
        _error(anon.get("/v1/models"), 401)
    with api_server.http("lp-0123456789abcdef." + "A" * 43) as bad:
        _error(bad.post("/v1/completions", json={"model": model, "prompt": "x"}), 401)
    with pytest.raises(openai.NotFoundError):
        api_server.client(key).completions.create(model="nope", prompt="x", max_tokens=2)


def test_health_and_metrics(api_server):
    name, key = api_server.new_tenant()
    api_server.client(key).completions.create(model=api_server.state.model_id, prompt="hi", max_tokens=3)
    with api_server.http() as h:
        health = h.get("/health")
        assert h.get("/metrics").status_code == 401  # names tenants: never without a credential
    with api_server.http(key) as h:
        assert h.get("/metrics").status_code == 403  # a tenant key is not one
    with api_server.http(api_server.config.admin_token) as h:
        metrics = h.get("/metrics").text
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert f'loraplex_requests_total{{endpoint="completions",outcome="ok",tenant="{name}"}} 1.0' in metrics
    assert f'loraplex_tokens_total{{kind="completion",tenant="{name}"}} 3.0' in metrics
    for family in ("loraplex_time_to_first_token_seconds_count", "loraplex_inter_token_latency_seconds_count",
                   "loraplex_queue_depth", "loraplex_running_batch_size", "loraplex_kv_blocks_used",
                   "loraplex_adapters_loaded"):
        assert family in metrics
    assert "loraplex_graph_replays_total 0.0" in metrics and "loraplex_cuda_graphs 0.0" in metrics  # CPU: eager
