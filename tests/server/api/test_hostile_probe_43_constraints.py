"""Issue 43's hostile probe, finding 6, against the real server: an unsatisfiable grammar or schema
(`root ::= root`, a `$ref` cycle with no base case) was a 503 "no token to choose" at the first step,
and `{"not": {}}` was ignored; each is now a 400 at compile that names the field (and the keyword)."""
from __future__ import annotations

import pytest

from tests.fixtures_server import api_redis_url, running_server, server_config

CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
P = {"a": {"type": "integer"}, "b": {"type": "integer"}}
MUTUAL = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("probe43-constraints"), api_redis_url(redis_server))
    with running_server(config, starter=core_starter) as handle:
        yield handle


@pytest.fixture(scope="module")
def key(server):
    return server.new_tenant()[1]


def _post(server, key, **fields):
    with server.http(key) as h:
        return h.post("/v1/completions", json={"model": server.state.model_id, "prompt": "x", "max_tokens": 4,
                                               **fields})


@pytest.mark.parametrize("field, value", [
    ("structured_outputs", {"grammar": "root ::= root"}),
    ("structured_outputs", {"grammar": "root ::= a\na ::= b\nb ::= a"}),
    ("guided_grammar", "root ::= root"),
    ("structured_outputs", {"json": CYCLE}),
    ("guided_json", MUTUAL),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "c", "schema": CYCLE}}),
])
def test_unsatisfiable_constraints_are_400s_at_compile(server, key, field, value):
    r = _post(server, key, **{field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "no output satisfies it" in error["message"], error


@pytest.mark.parametrize("schema, keyword", [
    ({"not": {}}, "not"),
    ({"type": "integer", "not": {"const": 1}}, "not"),
    ({"type": "object", "properties": {"a": {"type": "integer", "not": {"minimum": 3}}}}, "not"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "if"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    # The audit's finds: each passed a value the schema refuses.
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains"),
    ({"type": "object", "properties": P, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "properties": P, "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ({"type": "object", "properties": P, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "required"),
    ({"type": "object", "properties": P, "required": ["z"]}, "'z'"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"$defs": {"a": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, "$ref"),
    ({"type": "string", "enum": [1, "a"]}, "type"),
    ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, "oneOf"),
])
def test_unenforced_keywords_are_refused_by_name(server, key, schema, keyword):
    r = _post(server, key, structured_outputs={"json": schema})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs" and keyword in error["message"], error


def test_a_property_named_like_a_keyword_is_not_a_keyword(server, key):
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"enum": [1]}},
              "required": ["not", "if"], "additionalProperties": False}
    r = _post(server, key, structured_outputs={"json": schema}, max_tokens=40)
    assert r.status_code == 200, r.text


def _pet(kind: str, field: str) -> dict:
    return {"properties": {"t": {"const": kind, "type": "string"}, field: {"type": "integer"}},
            "required": ["t", field], "type": "object"}


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},  # disjoint by type
    {"$defs": {"Cat": _pet("cat", "m"), "Dog": _pet("dog", "b")}, "type": "object", "required": ["pet"],
     "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                            "discriminator": {"propertyName": "t"}}}},  # pydantic's discriminated union
    {"type": "integer", "multipleOf": 3},
    {"type": ["string", "null"], "enum": ["a", None]},
])
def test_what_is_enforced_still_compiles(server, key, schema):
    r = _post(server, key, structured_outputs={"json": schema}, max_tokens=40)
    assert r.status_code == 200, r.text
