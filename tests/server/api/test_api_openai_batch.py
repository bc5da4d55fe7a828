"""Batches of prompts, n choices, model retrieval, tokenize/detokenize and the published schema,
through the `openai` client and langchain's `OpenAI` batch calls."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

PROMPTS = ["The quick brown fox", "Once upon a time", "SELECT * FROM"]


def test_a_batch_equals_single_requests(api_server):
    _, key = api_server.new_tenant({"requests_per_minute": 100})
    c = api_server.client(key)
    model = api_server.state.model_id
    common = dict(model=model, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    singles = [c.completions.create(prompt=p, **common) for p in PROMPTS]
    batch = c.completions.create(prompt=PROMPTS, n=2, **common)
    assert [ch.index for ch in batch.choices] == list(range(6))  # prompt-major, then n
    for i, single in enumerate(singles):
        for j in range(2):
            assert batch.choices[i * 2 + j].text == single.choices[0].text
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    ids = [api_server.tokenizer(p).input_ids for p in PROMPTS]
    by_ids = c.completions.create(prompt=ids, **common)
    assert [ch.text for ch in by_ids.choices] == [s.choices[0].text for s in singles]
    # every prompt of a batch is a request for the quotas and the usage log: 3 singles + 3 + 3
    with api_server.http(key) as h:
        assert h.get("/v1/usage").json()["total"]["requests"] == 9


def test_batch_cap_and_all_or_nothing_quota(api_server):
    _, key = api_server.new_tenant({"max_concurrent_requests": 2})
    c = api_server.client(key)
    model = api_server.state.model_id
    with pytest.raises(openai.BadRequestError, match="max-batch-prompts"):
        c.completions.create(model=model, prompt=["x"] * (api_server.config.max_batch_prompts + 1), max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        c.completions.create(model=model, prompt=["a", "b", "c"], max_tokens=1)
    with api_server.http(key) as h:  # the two admitted before the refusal were released
        assert h.get("/v1/usage").json()["current"]["concurrent_requests"] == 0
    assert len(c.completions.create(model=model, prompt=["a", "b"], max_tokens=1).choices) == 2


def test_n_choices_greedy_seeded_and_streamed(api_server):
    _, key = api_server.new_tenant()
    c = api_server.client(key)
    model = api_server.state.model_id
    greedy = c.completions.create(model=model, prompt="hello", n=3, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert len({ch.text for ch in greedy.choices}) == 1
    seeded = [c.completions.create(model=model, prompt="hello", n=3, max_tokens=12, temperature=1, seed=5,
                                   extra_body={"ignore_eos": True}) for _ in range(2)]
    texts = [[ch.text for ch in r.choices] for r in seeded]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3
    chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2,
                                            max_tokens=6, temperature=1, seed=5, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert chunks[-1].usage.completion_tokens == 12
    whole = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2,
                                      max_tokens=6, temperature=1, seed=5, extra_body={"ignore_eos": True})
    assert [streamed[0], streamed[1]] == [ch.message.content for ch in whole.choices]


def test_langchain_openai_batch(api_server):
    from langchain_openai import OpenAI

    _, key = api_server.new_tenant()
    llm = OpenAI(base_url=f"{api_server.url}/v1", api_key=key, model=api_server.state.model_id, max_tokens=6,
                 temperature=0, max_retries=0, extra_body={"ignore_eos": True})
    out = llm.batch(PROMPTS)
    direct = [api_server.client(key).completions.create(model=api_server.state.model_id, prompt=p, max_tokens=6,
                                                        temperature=0, extra_body={"ignore_eos": True})
              .choices[0].text for p in PROMPTS]
    assert out == direct
    result = llm.generate(PROMPTS[:2])
    assert [g[0].text for g in result.generations] == direct[:2]


def test_retrieve_models(api_server, tiny_adapters):
    _, key = api_server.new_tenant()
    _, other = api_server.new_tenant()
    assert api_server.upload(key, "mine", tiny_adapters["r4_qv"]).status_code == 201
    assert api_server.upload(other, "theirs", tiny_adapters["r4_qv"]).status_code == 201
    c = api_server.client(key)
    base = c.models.retrieve(api_server.state.model_id)
    assert base.id == api_server.state.model_id and base.model_extra["max_model_len"] == 512
    assert c.models.retrieve("mine").model_extra["parent"] == api_server.state.model_id
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("theirs")  # another tenant's adapter is a plain 404


def test_tokenize_and_detokenize(api_server):
    _, key = api_server.new_tenant()
    model = api_server.state.model_id
    tok = api_server.tokenizer
    with api_server.http(key) as h:
        r = h.post("/tokenize", json={"model": model, "prompt": "hello world"}).json()
        assert r["tokens"] == tok("hello world").input_ids and r["count"] == len(r["tokens"])
        bare = h.post("/tokenize", json={"model": model, "prompt": "hello world", "add_special_tokens": False})
        assert bare.json()["tokens"] == tok("hello world", add_special_tokens=False).input_ids
        assert h.post("/detokenize", json={"model": model, "tokens": r["tokens"]}).json()["prompt"] == \
            tok.decode(r["tokens"])
        assert h.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
        assert h.post("/tokenize", json={"model": model}).status_code == 400
        assert h.post("/detokenize", json={"model": model, "tokens": [10**9]}).status_code == 400
    assert httpx.post(f"{api_server.url}/tokenize", json={"model": model, "prompt": "x"}).status_code == 401


def test_openapi_and_docs(api_server):
    doc = httpx.get(f"{api_server.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models/{model}", "/tokenize", "/v1/adapters",
                 "/admin/tenants", "/admin/tenants/{name}", "/v1/usage"):
        assert path in doc["paths"]
    request = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["temperature"]["maximum"] == 2.0 and request["n"]["maximum"] == 16
    page = httpx.get(f"{api_server.url}/docs")
    assert page.status_code == 200 and "openapi.json" in page.text and "<script" in page.text
    assert "http://" not in page.text.replace("http://www.w3.org", "") and "https://" not in page.text
    json.dumps(doc)
