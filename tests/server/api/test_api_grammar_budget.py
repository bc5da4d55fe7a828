"""The structured-output compile budget over HTTP: a compile holds its tenant's concurrency slot
(a second request at max_concurrent_requests 1 is a 429 while the first compiles), and each kind
of pathological constraint (deep nesting, a schema of many optional properties, a catastrophic regex) is refused with a 400
naming the limit it passed: --max-schema-bytes when it is too large to read, and
--max-grammar-compile-ms when it is small enough but slow to compile (its compile is killed past
that much CPU time, and the next request takes a warm spare process, not the replacement's start).
Nesting is bounded before that, by the body parser's depth limit: a 500-deep schema (48 s to
compile here) is refused unread, and the deepest schema a body may hold compiles at once."""
from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import pytest

from tests.fixtures_server import api_redis_url, running_server, server_config

COMPILE_MS = 3000
SCHEMA_BYTES = 200_000


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _optional_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


# kind -> (field, value under the byte cap that takes far longer than COMPILE_MS to compile, value
# over the byte cap). Optional properties cost xgrammar superlinear CPU time (on a Xeon 8480-class
# core: 600 of them 1.1 s, 2000 67 s), so 1200 pass the deadline on a fast CPU too, where a
# 6000-value enum (9 s on an EPYC Zen 1) compiled in 1.1 s; 1000 optional regex groups take over 15 s. Deep nesting never reaches the compiler: test_deep_nesting_is_refused_...
PATHOLOGICAL = {
    "many_optional_properties": ("guided_json", _optional_properties(1200), _optional_properties(8000)),
    "catastrophic_regex": ("guided_regex", "(a|b)?" * 1000, "(a|b)?" * 40000),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("grammar-budget"), api_redis_url(redis_server),
                           max_grammar_compile_ms=COMPILE_MS, max_schema_bytes=SCHEMA_BYTES)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _complete(server, key: str, **fields) -> httpx.Response:
    body = {"model": server.state.model_id, "prompt": "x", "max_tokens": 4, "temperature": 0, **fields}
    with server.http(key) as c:
        return c.post("/v1/completions", json=body, timeout=300)


def _concurrent(server, key: str) -> int:
    with server.http(key) as c:
        return c.get("/v1/usage").json()["current"]["concurrent_requests"]


def test_a_compile_holds_the_tenants_concurrency_slot(server):
    _, key = server.new_tenant({"max_concurrent_requests": 1})
    slow = PATHOLOGICAL["catastrophic_regex"][1]
    first: list[httpx.Response] = []
    holder = threading.Thread(target=lambda: first.append(_complete(server, key, guided_regex=slow)), daemon=True)
    holder.start()
    compiler = server.state.grammar_compiler
    deadline = time.monotonic() + 120
    while compiler.running != 1:  # its compile asked for (a process may still be starting)
        assert time.monotonic() < deadline and holder.is_alive(), "the first request never started its compile"
        time.sleep(0.02)
    assert _concurrent(server, key) == 1
    second = _complete(server, key, guided_choice=["ok"])
    assert compiler.running == 1, "the first compile ended before the second request was answered"
    assert second.status_code == 429 and second.json()["error"]["code"] == "max_concurrent_requests", second.text
    assert "Retry-After" in second.headers
    holder.join(300)
    assert first[0].status_code == 400 and "--max-grammar-compile-ms" in first[0].json()["error"]["message"]
    # the killed compile gave the slot back: the tenant's next constrained request runs
    deadline = time.monotonic() + 10
    while _concurrent(server, key):  # released as the refusal settles, just after its answer
        assert time.monotonic() < deadline, "the killed compile kept its concurrency slot"
        time.sleep(0.02)
    again = _complete(server, key, guided_choice=["ok"])
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == "ok", again.text


@pytest.mark.parametrize("kind", list(PATHOLOGICAL))
def test_a_pathological_constraint_is_refused_naming_the_limit(server, kind):
    field, slow, large = PATHOLOGICAL[kind]
    _, key = server.new_tenant()
    r = _complete(server, key, **{field: large})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "--max-schema-bytes" in err["message"] and str(SCHEMA_BYTES) in err["message"]
    compiler = server.state.grammar_compiler
    deadline = time.monotonic() + 300
    while not compiler.all_started:  # a spare is warm (the last kill's replacement has started)
        assert time.monotonic() < deadline, "the grammar compile processes never all started"
        time.sleep(0.05)
    r = _complete(server, key, **{field: slow})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # Killed at its CPU-time deadline, or at ten times that on the wall clock when a loaded machine
    # starves the compile process: both are that flag's refusal.
    assert err["param"] == field and "(--max-grammar-compile-ms)" in err["message"], err
    assert f"{COMPILE_MS} ms of CPU time" in err["message"] or f"{10 * COMPILE_MS} ms wall-clock" in err["message"]
    # the killed process's replacement starts in the background: the next compile takes the spare
    cold = compiler.cold_starts
    r = _complete(server, key, guided_choice=[f"after-{kind}"], max_tokens=32)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == f"after-{kind}", r.text
    assert compiler.cold_starts == cold, "the compile after a kill waited for a process start"
    with server.http(server.config.admin_token) as c:
        assert c.get("/admin/engine").json()["structured_output"]["compiles_running"] == 0


def test_deep_nesting_is_refused_by_the_body_depth_limit_before_any_compile(server):
    _, key = server.new_tenant()
    compiles = server.state.grammar_compiler.grammars.stats().compiles
    r = _complete(server, key, guided_json=_nested(500))
    assert r.status_code == 400 and "nested deeper than 32 levels" in r.json()["error"]["message"], r.text
    assert server.state.grammar_compiler.grammars.stats().compiles == compiles  # refused unread
    r = _complete(server, key, guided_json=_nested(28), max_tokens=80)  # the deepest the body allows
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["text"]), _nested(28))
    else:
        assert choice["finish_reason"] == "length" and choice["text"].startswith("[" * 28)
