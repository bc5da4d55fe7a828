"""The grammar compile process starts in the background once the server is ready (server.api.app):
one idle process and nothing more before any constraint arrives, and the first constrained request,
sent after it has started, takes it warm (`compile_cold_starts` in /admin/engine stays 0)."""
from __future__ import annotations

import time

import pytest

from tests.fixtures_server import api_redis_url, running_server, server_config


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("grammar-prestart"), api_redis_url(redis_server))
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _engine_view(server) -> dict:
    with server.http(server.config.admin_token) as c:
        r = c.get("/admin/engine")
    assert r.status_code == 200, r.text
    return r.json()["structured_output"]


def test_the_first_constrained_request_after_start_up_takes_a_warm_process(server):
    compiler = server.state.grammar_compiler
    deadline = time.monotonic() + 300
    while not (compiler.all_started and compiler.idle_processes):
        assert time.monotonic() < deadline, "the prestarted grammar compile process never started"
        time.sleep(0.05)
    assert compiler.idle_processes == 1 and compiler.running == 0  # one process only, until a constraint comes
    view = _engine_view(server)
    assert view["compile_cold_starts"] == 0 and view["compiles"] == 0
    _, key = server.new_tenant()
    body = {"model": server.state.model_id, "prompt": "x", "max_tokens": 16, "temperature": 0,
            "guided_choice": ["warm-start"]}
    with server.http(key) as c:
        r = c.post("/v1/completions", json=body, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "warm-start", r.text
    view = _engine_view(server)
    assert view["compiles"] == 1 and view["compile_cold_starts"] == 0
