"""Every request field is honoured or refused (issue 25): unknown fields are a 400 naming them, another
server's adapter selector is never ignored, every validation error is a 400 with `param`, and the
operator's --lenient-request-fields ignores unknown fields but says which in a response header.
Real redis, uvicorn and the openai client."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.fixtures_server import ServerHandle, api_redis_url, running_server, server_config

HEADER = "x-loraplex-ignored-fields"


@pytest.fixture(scope="module")
def lenient_server(tmp_path_factory, tiny_model_dir, redis_server, core_starter) -> Iterator[ServerHandle]:
    # Its own key prefix in the shared db: the strict module server keeps its tenants.
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("lenient-data"),
                           api_redis_url(redis_server, flush=False), redis_prefix="lp-lenient:",
                           lenient_request_fields=True)
    with running_server(config, starter=core_starter) as handle:
        yield handle


@pytest.fixture(scope="module")
def tenant(api_server, tiny_adapters) -> str:
    _, key = api_server.new_tenant()
    assert api_server.upload(key, "sql", tiny_adapters["r8_all"]).status_code == 201
    return key


def _bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return info.value.body


def _greedy(client: openai.OpenAI, model: str, **extra) -> str:
    return client.completions.create(model=model, prompt="hello there", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, **extra}).choices[0].text


def test_unknown_fields_are_refused_by_name(api_server, tenant):
    c = api_server.client(tenant)
    model = api_server.state.model_id
    err = _bad_request(lambda: c.completions.create(model=model, prompt="x", max_tokens=2,
                                                    extra_body={"frobnicate": 1}))
    assert err["param"] == "frobnicate" and "frobnicate" in err["message"] and err["code"] == "unknown_field"
    assert "--lenient-request-fields" in err["message"]
    err = _bad_request(lambda: c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=2, extra_body={"return_token_ids": True}))
    assert err["param"] == "return_token_ids"
    with api_server.http(tenant) as h:
        for path, body in (("/tokenize", {"model": model, "prompt": "x", "return_token_strs": True}),
                           ("/detokenize", {"model": model, "tokens": [1], "extra": 1})):
            r = h.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == list(body)[-1], r.text
        # a nested unknown field is refused too, naming where it is
        r = h.post("/v1/completions", json={"model": model, "prompt": "x", "stream": True,
                                            "stream_options": {"include_usage": True, "bogus": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.bogus", r.text


@pytest.mark.parametrize("selector", [
    {"parameters": {"adapter_id": "sql"}},   # TGI's and LoRAX's /generate body
    {"lora_request": {"lora_name": "sql", "lora_int_id": 1, "lora_path": "/x"}},   # vLLM's offline API
    {"lora_path": "sql"},                    # SGLang
    {"adapter": "sql"},
])
def test_foreign_adapter_selectors_are_refused(api_server, tenant, selector):
    c = api_server.client(tenant)
    err = _bad_request(lambda: c.completions.create(model=api_server.state.model_id, prompt="x", max_tokens=2,
                                                    extra_body=selector))
    name = next(iter(selector))
    assert err["param"] == ("parameters.adapter_id" if name == "parameters" else name)
    assert err["code"] == "unsupported_adapter_selector" and "'model'" in err["message"]


def test_lorax_adapter_id_selects_the_adapter(api_server, tenant):
    c = api_server.client(tenant)
    base = api_server.state.model_id
    by_model = _greedy(c, "sql")
    assert _greedy(c, base, adapter_id="sql") == by_model != _greedy(c, base)


def test_supported_vllm_and_openai_extras_are_accepted(api_server, tenant):
    """The parameter table (docs/http-api.md): each of these is read, so none is refused as unknown."""
    c = api_server.client(tenant)
    extras = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True,
              "stop_token_ids": [3], "prompt_logprobs": 1, "priority": 0, "cache_salt": "s1",
              "metadata": {"run": "a"}, "service_tier": "auto"}
    r = c.completions.create(model="sql", prompt="hello", max_tokens=3, temperature=0, seed=1, user="u1",
                             extra_body=extras)
    assert r.choices[0].finish_reason in ("length", "stop")
    r = c.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                  temperature=0, extra_body={"top_k": 5, "min_p": 0.01, "ignore_eos": True})
    assert r.choices[0].message.content is not None
    err = _bad_request(lambda: c.completions.create(model="sql", prompt="x", max_tokens=2, extra_body={"store": True}))
    assert err["param"] == "store"


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
])
def test_media_content_parts_say_they_are_unsupported(api_server, tenant, part):
    c = api_server.client(tenant)
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    err = _bad_request(lambda: c.chat.completions.create(model="sql", messages=messages, max_tokens=2))
    assert err["param"] == "messages[0].content[1]", err
    assert part["type"] in err["message"] and "not supported" in err["message"]
    with api_server.http(tenant) as h:
        r = h.post("/tokenize", json={"model": "sql", "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]"


def test_every_validation_error_is_400_with_param(api_server, tenant):
    model = api_server.state.model_id
    cases = [
        ("/v1/chat/completions", {"model": model, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "robot", "content": "x"}]},
         "messages[0].role"),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": [{"type": "x"}]}]},
         "messages[0].content[0]"),
        ("/v1/completions", {"model": model}, "prompt"),
        ("/v1/completions", {"model": model, "prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"model": model, "prompt": "x", "n": "two"}, "n"),
        ("/v1/completions", {"model": model, "prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 100000}, "max_tokens"),  # the field past the limit
    ]
    with api_server.http(tenant) as h:
        for path, body, param in cases:
            r = h.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    admin_cases = [({"name": "Bad Name!"}, "name"), ({"name": "okname", "quotas": {}}, "quotas"),
                   ({"name": "okname", "quota": {"weight": 0}}, "quota.weight")]
    for body, param in admin_cases:
        r = api_server.admin("POST", "/admin/tenants", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_openapi_publishes_no_422(api_server):
    doc = httpx.get(f"{api_server.url}/openapi.json").json()
    statuses = {status for ops in doc["paths"].values() for op in ops.values() for status in op["responses"]}
    assert "422" not in statuses and "400" in statuses
    assert "param" in doc["components"]["schemas"]["ErrorBody"]["properties"]
    # the generation bodies publish that they take no field beyond those listed
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        assert doc["components"]["schemas"][name]["additionalProperties"] is False, name


def test_lenient_mode_ignores_unknown_fields_and_names_them(lenient_server, tiny_adapters):
    _, key = lenient_server.new_tenant()
    model = lenient_server.state.model_id
    with lenient_server.http(key) as h:
        plain = h.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True})
        assert plain.status_code == 200 and HEADER not in plain.headers
        r = h.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0,
                                            "ignore_eos": True, "return_token_ids": True, "weird\nname": 1})
        assert r.status_code == 200, r.text
        assert r.headers[HEADER] == "return_token_ids, weird\\u000aname"
        assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        # streamed answers carry it too
        with h.stream("POST", "/v1/chat/completions",
                      json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                            "stream": True, "vllm_xargs": {}}) as s:
            assert s.status_code == 200 and s.headers[HEADER] == "vllm_xargs"
            assert list(s.iter_lines())[-2:] == ["data: [DONE]", ""]
        r = h.post("/tokenize", json={"model": model, "prompt": "x", "return_token_strs": True})
        assert r.status_code == 200 and r.headers[HEADER] == "return_token_strs"
        # an adapter selector is never ignored, lenient or not
        r = h.post("/v1/completions", json={"model": model, "prompt": "x", "lora_request": {"lora_name": "a"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_request"
        # the admin API stays strict
        r = h.post("/admin/tenants", json={"name": "x1", "quotas": {}},
                   headers={"Authorization": f"Bearer {lenient_server.config.admin_token}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "quotas"


def test_a_large_body_is_validated_as_a_small_one_is(api_server, lenient_server):
    # Past 64 kB a body is parsed and validated on a worker thread (not the event loop): the same
    # answers there, strict and lenient, as for a small body.
    for server in (api_server, lenient_server):
        model = server.state.model_id
        length = min(server.state.engine.info.max_model_len - 2, 1000)
        batch = [[5] * length] * (24_000 // length + 1)  # ~72 kB of JSON
        _, key = server.new_tenant()
        with server.http(key) as h:
            r = h.post("/v1/completions", json={"model": model, "prompt": batch, "max_tokens": 1, "extra_thing": 1})
            if server is api_server:
                assert r.status_code == 400 and r.json()["error"]["param"] == "extra_thing", r.text
            else:
                assert r.status_code == 200 and r.headers[HEADER] == "extra_thing", r.text
                assert len(r.json()["choices"]) == len(batch)
            r = h.post("/v1/completions", json={"model": model, "prompt": batch, "max_tokens": -1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
