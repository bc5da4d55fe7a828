"""A hostile tenant's requests, through a real server: none kills the engine, none answers 500,
none makes another tenant wait. Each case here crashed, 500'd or stalled the server before."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.hostile_helpers import Victim, stream_text, victim_body


@pytest.fixture(scope="module")
def victim_reference(api_server) -> str:
    """The victim's text when nothing else runs (greedy: the same every time it is served correctly)."""
    _, key = api_server.new_tenant()
    text, usage = stream_text(api_server.url, key, victim_body(api_server.state.model_id))
    assert usage["completion_tokens"] > 0
    return text


@pytest.mark.parametrize("knob", [{"top_p": 1e-320}, {"top_p": 1e-46}, {"temperature": 1e-40},
                                  {"temperature": 1e-320}, {"temperature": 5e-324, "top_p": 5e-324}])
def test_tiny_sampling_values_do_not_kill_the_engine(api_server, victim_reference, knob):
    model = api_server.state.model_id
    _, attacker = api_server.new_tenant()
    _, victim_key = api_server.new_tenant()
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, **knob}
    with Victim(api_server.url, victim_key, model) as victim:
        with api_server.http(attacker) as h:
            for _ in range(3):
                r = h.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] >= 1
    victim.assert_completed(victim_reference)
    assert api_server.state.engine.is_healthy
    # and the next request of anyone is served
    assert stream_text(api_server.url, victim_key, victim_body(model))[0] == victim_reference


def _status(response: httpx.Response) -> int:
    assert response.headers["content-type"].startswith("application/json"), response.text
    assert "error" in response.json()
    return response.status_code


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("method,path,admin", [("POST", "/v1/completions", False),
                                               ("POST", "/v1/chat/completions", False),
                                               ("POST", "/admin/tenants", True),
                                               ("PATCH", "/admin/tenants/{tenant}", True)])
def test_malformed_json_bodies_are_4xx(api_server, method, path, admin):
    tenant, key = api_server.new_tenant()
    token = api_server.config.admin_token if admin else key
    bodies = {
        "deep": DEEP.encode(),
        "deep object": ('{"a":' * 50_000 + "1" + "}" * 50_000).encode(),
        "deep field": ('{"model": "x", "prompt": ' + DEEP + "}").encode(),
        "huge int": b'{"model": "x", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        "nan": b'{"model": "x", "prompt": "hi", "temperature": NaN}',
        "surrogate": b'{"model": "x", "prompt": "\\ud800", "name": "\\udfff"}',
        "not utf-8": b'{"model": "\xff\xfe"}',
        "not json": b"{",
        "array": b"[1, 2]",
    }
    with api_server.http(token) as h:
        for what, raw in bodies.items():
            r = h.request(method, path.format(tenant=tenant), content=raw,
                          headers={"content-type": "application/json"})
            assert _status(r) == 400, (what, r.status_code, r.text)


def test_surrogates_in_prompt_message_and_model_are_400(api_server):
    _, key = api_server.new_tenant()
    model = api_server.state.model_id
    cases = [("/v1/completions", '{"model": "%s", "prompt": "a\\ud800b"}' % model),
             ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}' % model),
             ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": '
                                      '[{"type": "text", "text": "\\ud83d"}]}]}' % model),
             ("/v1/completions", '{"model": "x\\ud800", "prompt": "hi"}')]
    with api_server.http(key) as h:
        for path, raw in cases:
            r = h.post(path, content=raw.encode(), headers={"content-type": "application/json"})
            assert _status(r) == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_query_parameters_are_validated(api_server):
    _, key = api_server.new_tenant()
    with api_server.http(key) as h:
        for days in ("9" * 5000, "-1", "0", "1.5", "²", "", "1e3", "91"):
            r = h.get("/v1/usage", params={"days": days})
            assert _status(r) == 400, (days, r.text)
        assert h.get("/v1/usage", params={"days": "7"}).status_code == 200


def test_body_over_the_cap_is_413_before_it_is_read(api_server):
    _, key = api_server.new_tenant()
    cap = api_server.config.max_request_bytes
    body = b'{"model": "x", "prompt": "' + b"a" * (cap + 1) + b'"}'
    with api_server.http(key) as h:
        r = h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert _status(r) == 413 and "max-request-bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the running count must stop it
            yield b'{"model": "x", "prompt": "'
            for _ in range(cap // (1 << 20) + 2):
                yield b"a" * (1 << 20)
            yield b'"}'
        r = h.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert _status(r) == 413


def test_huge_prompt_is_refused_before_tokenizing_and_others_do_not_wait(api_server, victim_reference):
    model = api_server.state.model_id
    _, attacker = api_server.new_tenant()
    _, victim_key = api_server.new_tenant()
    cap_chars = api_server.state.prompts.max_prompt_chars
    prompt = "word " * (api_server.config.max_request_bytes // 6)  # ~13 MB: under the body cap
    assert len(prompt) > cap_chars
    times: dict[str, float] = {}

    def attack() -> None:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1})
        start = time.monotonic()
        with api_server.http(attacker) as h:
            for _ in range(3):
                r = h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        times["attack"] = time.monotonic() - start

    thread = threading.Thread(target=attack)
    thread.start()
    start = time.monotonic()
    with api_server.http(victim_key) as h:
        r = h.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
    times["victim"] = time.monotonic() - start
    thread.join(60)
    assert r.status_code == 200
    # Tokenizing 13 MB took tens of seconds and gigabytes; refused unread it is a JSON parse away.
    assert times["attack"] < 20 and times["victim"] < 10, times
    # The same for chat: the conversation's characters are counted before the template runs.
    body = {"model": model, "messages": [{"role": "user", "content": "x" * (cap_chars // 2 + 1)}] * 2}
    with api_server.http(attacker) as h:
        r = h.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert stream_text(api_server.url, victim_key, victim_body(model))[0] == victim_reference


def test_token_prompt_longer_than_the_context_is_400(api_server):
    _, key = api_server.new_tenant()
    limit = api_server.state.engine.info.max_model_len
    with api_server.http(key) as h:
        r = h.post("/v1/completions", json={"model": api_server.state.model_id, "prompt": [5] * (limit + 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("field,value", [("max_tokens", 10**30), ("seed", 2**64), ("priority", 2**40),
                                         ("stop_token_ids", list(range(1000))), ("stop", ["x" * 5000]),
                                         ("model", "m" * 10_000), ("top_k", -2), ("temperature", 1e308),
                                         ("top_p", 0.0), ("max_tokens", 0)])
def test_out_of_range_fields_are_400(api_server, field, value):
    _, key = api_server.new_tenant()
    body = {"model": api_server.state.model_id, "prompt": "hi", "max_tokens": 2, field: value}
    with api_server.http(key) as h:
        r = h.post("/v1/completions", json=body)
    assert _status(r) == 400, r.text
