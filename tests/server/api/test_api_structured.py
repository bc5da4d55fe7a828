"""Structured output over HTTP with the `openai` client: every way to ask for a constraint, in
completions and chat, streamed and not, n > 1, with an adapter and without. The tiny model
writes gibberish; under a constraint every completed output must still be valid."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.fixtures_server import api_redis_url, running_server, server_config

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 2},
    },
    "required": ["id", "color", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,6}( [0-9]{1,3})?"
CHOICES = ["positive", "negative", "neutral"]
EBNF = 'root ::= "<" word ">" \nword ::= [a-z] [a-z]?'
SLOW_SCHEMA = {"enum": [f"v{i:05d}abcdefghijklmnopqrst" for i in range(6000)]}  # ~9 s to compile here

# name -> (request fields, validator of the completed text)
FORMS = {
    # Greedy (the extra body's temperature wins): sampled, the random model's free-form objects
    # rarely close within max_tokens.
    "json_object": ({"response_format": {"type": "json_object"}, "temperature": 0},
                    lambda t: isinstance(json.loads(t), dict)),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "item", "schema": SCHEMA, "strict": True}}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "structured_outputs": ({"structured_outputs": {"json": SCHEMA}},
                           lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "guided_json": ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "guided_regex": ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "guided_choice": ({"guided_choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(t)),
    "guided_grammar": ({"guided_grammar": EBNF}, lambda t: re.fullmatch(r"<[a-z]{1,2}>", t) or pytest.fail(t)),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("structured-data"), api_redis_url(redis_server),
                           max_grammar_compile_ms=1000, max_schema_bytes=200_000)
    with running_server(config, starter=core_starter) as handle:
        yield handle


@pytest.fixture(scope="module")
def tenant(server, tiny_adapters):
    _, key = server.new_tenant()
    assert server.upload(key, "ad", tiny_adapters["r8_all"]).status_code == 201
    return server.client(key)


def _request(client: openai.OpenAI, chat: bool, model: str, stream: bool, fields: dict, **kw):
    """[(text, finish_reason)] per choice, streamed pieces joined."""
    common = dict(model=model, n=2, temperature=0.9, seed=11, max_tokens=300, stream=stream, extra_body=fields, **kw)
    if chat:
        r = client.chat.completions.create(messages=[{"role": "user", "content": "give me data"}], **common)
    else:
        r = client.completions.create(prompt="data:", **common)
    if not stream:
        return [((c.message.content if chat else c.text), c.finish_reason) for c in r.choices]
    texts, reasons = {}, {}
    for chunk in r:
        for c in chunk.choices:
            piece = (c.delta.content if chat else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return [(texts[i], reasons[i]) for i in sorted(texts)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("form", list(FORMS))
def test_constraint_forms(server, tenant, form, chat):
    fields, valid = FORMS[form]
    stopped = 0
    for model in (server.state.model_id, "ad"):
        answers = {}
        for stream in (False, True):
            answers[stream] = _request(tenant, chat, model, stream, fields)
            for text, reason in answers[stream]:
                assert reason in ("stop", "length")
                if reason == "stop":
                    valid(text)
                    stopped += 1
        assert answers[True] == answers[False]  # seeded: streaming changes nothing but the delivery
    assert stopped >= 2  # gibberish may run past max_tokens, but not every choice of 8


def test_completed_json_respects_max_tokens_with_length(server, tenant):
    r = tenant.completions.create(model="ad", prompt="x", max_tokens=3, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "s", "schema": SCHEMA}}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith("{")


def _bad(tenant, **fields) -> dict:
    with pytest.raises(openai.BadRequestError) as err:
        tenant.completions.create(model="ad", prompt="x", max_tokens=4, extra_body=fields)
    return err.value.body


def test_malformed_and_conflicting_constraints_are_400s(tenant):
    assert _bad(tenant, guided_regex="(")["param"] == "guided_regex"
    assert _bad(tenant, guided_grammar="root ::= ")["param"] == "guided_grammar"
    assert _bad(tenant, response_format={"type": "json_schema", "json_schema": {"name": "x"}})["param"] == \
        "response_format.json_schema.schema"
    assert _bad(tenant, response_format={"type": "yaml"})["param"] == "response_format.type"
    assert _bad(tenant, structured_outputs={"json": SCHEMA, "regex": "a"})["param"] == "structured_outputs"
    assert _bad(tenant, structured_outputs={"whitespace_pattern": " "})["param"] == \
        "structured_outputs.whitespace_pattern"
    body = _bad(tenant, guided_regex="a+", guided_choice=["a"])
    assert "only use one kind" in body["message"]


def test_schema_size_and_compile_time_are_bounded(server, tenant):
    huge = {"enum": ["x" * 100] * 3000}  # 300 kB > --max-schema-bytes 200000
    body = _bad(tenant, guided_json=huge)
    assert body["param"] == "guided_json" and "--max-schema-bytes" in body["message"]
    body = _bad(tenant, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SLOW_SCHEMA}})
    assert body["param"] == "response_format" and "--max-grammar-compile-ms" in body["message"]
    # The killed compile's process is replaced: the next constraint compiles.
    r = tenant.completions.create(model="ad", prompt="x", max_tokens=20, temperature=0,
                                  extra_body={"guided_choice": ["again"]})
    assert r.choices[0].text == "again"
    with server.http() as h:
        view = h.get("/admin/engine", headers={"authorization": f"Bearer {server.config.admin_token}"}).json()
    so = view["structured_output"]
    assert so["compile_timeouts"] >= 1 and so["compiles"] >= 1 and so["constrained_requests"] >= 1
    with server.http() as h:
        metrics = h.get("/metrics", headers={"authorization": f"Bearer {server.config.admin_token}"}).text
    assert re.search(r"^loraplex_grammar_cache_hits \d", metrics, re.M)
    assert re.search(r"^loraplex_constrained_requests [1-9]", metrics, re.M)
