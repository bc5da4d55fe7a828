"""Issue 42, item 8's API details against the real server: an oversized max_tokens names
`param: "max_tokens"`, the base model's usage is keyed by its id (records written under "" read the
same), `/version` is in /openapi.json, and /docs gives every method it lists a badge."""
from __future__ import annotations

import re

import httpx

from tests.repo import ROOT_DIR


def test_an_oversized_max_tokens_names_max_tokens(api_server):
    _, key = api_server.new_tenant()
    limit = api_server.state.engine.info.max_model_len
    model = api_server.state.model_id
    with api_server.http(key) as h:
        chat = h.post("/v1/chat/completions", json={"model": model, "max_tokens": limit,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        text = h.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": limit})
        too_long = h.post("/v1/completions", json={"model": model, "prompt": [5] * (limit + 1), "max_tokens": 1})
    for r in (chat, text):
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.json()["error"]["param"] == "max_tokens", r.text
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt", too_long.text


def test_base_model_usage_is_keyed_by_its_id(api_server):
    name, key = api_server.new_tenant()
    model = api_server.state.model_id
    api_server.client(key).completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    # a record written before the fix (under "") reads under the id too, added to the new ones
    api_server.state.usage.record(api_server.state.tenants.get(name), 3, 4)
    with api_server.http(key) as h:
        adapters = h.get("/v1/usage").json()["total"]["adapters"]
    assert set(adapters) == {model} and adapters[model]["requests"] == 2
    assert adapters[model]["completion_tokens"] == 2 + 4
    admin = api_server.admin("GET", f"/admin/tenants/{name}/usage").json()["total"]["adapters"]
    assert admin == adapters


def test_version_is_in_openapi_and_docs_badge_every_method(api_server):
    doc = httpx.get(f"{api_server.url}/openapi.json").json()
    op = doc["paths"]["/version"]["get"]
    schema = op["responses"]["200"]["content"]["application/json"]["schema"]
    ref = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    assert set(httpx.get(f"{api_server.url}/version").json()) <= set(ref["properties"])
    methods = {m for ops in doc["paths"].values() for m in ops}
    assert "put" in methods
    css = (ROOT_DIR / "server" / "api" / "web" / "docs.css").read_text()
    styled = set(re.findall(r"\.(get|post|put|patch|delete)\s*\{\s*background", css))
    assert methods <= styled, methods - styled
