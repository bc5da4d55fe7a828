"""Fair under abuse (issue 22): admission before the body, bounded bodies and responses, quotas on
every endpoint and every token, refused requests never billed, and the small API mismatches.
Each test is a failure that was seen on a real server."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.fixtures_server import ServerHandle, api_redis_url, running_server, server_config


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, core_starter) -> Iterator[ServerHandle]:
    # A minute's window, as in production: a charge must not leave the window while a test reads it.
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("abuse-data"), api_redis_url(redis_server),
                           rate_window_seconds=60.0)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _post(server: ServerHandle, key: str, path: str, body: dict) -> httpx.Response:
    with server.http(key) as h:
        return h.post(path, json=body)


def _usage(server: ServerHandle, key: str) -> dict:
    with server.http(key) as h:
        return h.get("/v1/usage").json()


def _answer_before_body(server: ServerHandle, key: str, path: str, declared: int) -> tuple[int, dict]:
    """Send the headers of a `declared`-byte body and only its first bytes, then read the answer:
    a server that waits for the body to parse it never answers."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall((f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n").encode()
                  + b'{"model": "x", "prompt": [1,')
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < _content_length(raw):
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def _content_length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


def test_huge_token_array_is_refused_before_it_is_built(server):
    _, key = server.new_tenant()
    ids = "[" + ",".join(["1234"] * 3_000_000) + "]"
    body = ('{"model": "%s", "prompt": %s, "max_tokens": 1}' % (server.state.model_id, ids)).encode()
    assert len(body) > 14 << 20
    with server.http(key) as h:
        r = h.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    # The pre-scan's answer, not the context-length check that would follow a full parse.
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_values", r.text
    assert "values" in r.json()["error"]["message"]
    # a body at the limit of what a request can use still parses: a full batch of max-length prompts
    limit = server.state.engine.info.max_model_len
    full = {"model": server.state.model_id, "prompt": [[7] * (limit - 1)] * 4, "max_tokens": 1}
    r = _post(server, key, "/v1/completions", full)
    assert r.status_code == 200, r.text
    # commas inside strings are not values: the prompt's length is what refuses this one
    r = _post(server, key, "/v1/completions", {"model": server.state.model_id, "prompt": "a,\\\"," * 200_000,
                                               "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert server.state.engine.is_healthy


def test_an_over_quota_tenant_gets_429_before_its_body_is_read(server):
    _, key = server.new_tenant({"requests_per_minute": 1})
    assert _post(server, key, "/v1/completions", {"model": server.state.model_id, "prompt": "hi",
                                                  "max_tokens": 1}).status_code == 200
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        status, body = _answer_before_body(server, key, path, 16 << 20)
        assert status == 429 and body["error"]["code"] == "requests_per_minute", (path, body)
    # the same for a tenant at its concurrency limit: its other requests wait for no body. The held
    # request runs in a thread (with the engine paused its answer only starts once the pause ends).
    _, busy = server.new_tenant({"max_concurrent_requests": 1})
    held: list[httpx.Response] = []
    with server.engine_paused():
        holder = threading.Thread(target=lambda: held.append(_post(server, busy, "/v1/completions", {
            "model": server.state.model_id, "prompt": "hi", "max_tokens": 4})), daemon=True)
        holder.start()
        deadline = time.monotonic() + 30
        while _usage(server, busy)["current"]["concurrent_requests"] != 1:
            assert time.monotonic() < deadline, "the held request never took its concurrency slot"
            time.sleep(0.05)
        status, body = _answer_before_body(server, busy, "/v1/completions", 1 << 20)
        assert status == 429 and body["error"]["code"] == "max_concurrent_requests", body
    holder.join(30)
    assert held and held[0].status_code == 200


def test_tokenize_and_detokenize_count_against_the_rate_and_are_capped(server):
    name, key = server.new_tenant({"requests_per_minute": 3})
    model = server.state.model_id
    limit = server.state.engine.info.max_model_len
    # refused requests do not count ...
    r = _post(server, key, "/detokenize", {"model": model, "tokens": [1] * (limit + 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert str(limit) in r.json()["error"]["message"]
    assert _post(server, key, "/tokenize", {"model": model}).status_code == 400
    # ... served ones do, with completions
    assert _post(server, key, "/tokenize", {"model": model, "prompt": "hello"}).status_code == 200
    assert _post(server, key, "/detokenize", {"model": model, "tokens": [1] * limit}).status_code == 200
    assert _usage(server, key)["current"]["requests_in_window"] == 2
    assert _post(server, key, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1}).status_code == 200
    for path, body in (("/tokenize", {"model": model, "prompt": "hello"}), ("/detokenize", {"model": model, "tokens": [1]})):
        r = _post(server, key, path, body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "requests_per_minute", r.text
    current = _usage(server, key)["current"]
    assert current["requests_in_window"] == 3 and current["concurrent_requests"] == 0


def test_logprob_output_budget_is_a_400_naming_the_limit(server):
    _, key = server.new_tenant()
    model = server.state.model_id
    cap = server.config.max_logprob_entries
    # the 200 MB response: 64 prompts of 500 ids, echoed with 20 alternatives each
    body = {"model": model, "prompt": [[5] * 500] * 64, "max_tokens": 1, "echo": True, "logprobs": 20,
            "prompt_logprobs": 20}
    r = _post(server, key, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_logprob_entries", r.text
    assert "--max-logprob-entries" in r.json()["error"]["message"] and str(cap) in r.json()["error"]["message"]
    assert str(64 * 501 * 21) in r.json()["error"]["message"]
    # within the budget it is served, and counted as billed
    r = _post(server, key, "/v1/completions", {**body, "prompt": [[5] * 50] * 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 51
    assert _usage(server, key)["total"]["requests"] == 2  # the two prompts of the served batch only


def test_a_large_over_budget_body_is_refused_from_its_raw_counts(server):
    """Decided before validation (server.api.raw_cost): a bad temperature beside it is not what the
    400 names, and the message is the budget check's own, exact to the entry."""
    _, key = server.new_tenant()
    model = server.state.model_id
    body = {"model": model, "prompt": [[1234] * 500] * 60, "max_tokens": 2, "n": 2, "echo": True, "logprobs": 3,
            "temperature": "hot"}
    assert len(json.dumps(body, separators=(",", ":"))) > 64 << 10  # as httpx sends it
    r = _post(server, key, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_logprob_entries", r.text
    assert f"up to {60 * 2 * 502 * 4} logprob entries" in r.json()["error"]["message"]
    # the route's earlier checks keep their order and messages: a batch too large, a prompt too long
    limit = server.state.engine.info.max_model_len
    r = _post(server, key, "/v1/completions", {**body, "prompt": [[1234] * 500] * 65})
    assert r.status_code == 400 and "at most 64 (--max-batch-prompts)" in r.json()["error"]["message"], r.text
    r = _post(server, key, "/v1/completions", {**body, "prompt": [[1234] * 500] * 59 + [[5] * (limit + 1)]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # within every bound, the ordinary path validates it: the temperature is what is wrong
    r = _post(server, key, "/v1/completions", {**body, "logprobs": None, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_max_tokens_per_request_bounds_prompts_times_n_times_max_tokens(server):
    _, key = server.new_tenant({"max_tokens_per_request": 10})
    model = server.state.model_id
    base = {"model": model, "prompt": "hello", "ignore_eos": True}
    for extra in ({"max_tokens": 11}, {"max_tokens": 10, "n": 2}, {"max_tokens": 10, "prompt": ["a", "b"]}):
        r = _post(server, key, "/v1/completions", {**base, **extra})
        assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_per_request", (extra, r.text)
    r = _post(server, key, "/v1/completions", {**base, "max_tokens": 5, "n": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10, r.text
    # chat without max_tokens shares the cap among its n choices
    r = _post(server, key, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                    "n": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10, r.text
    assert _usage(server, key)["total"]["requests"] == 2


def test_max_tokens_per_request_is_checked_before_the_prompts_are_tokenized(server):
    # 64 prompts x n 16 x max_tokens 10 is known from the body alone: refused without a tokenizer
    # call, so a prompt that the tokenizer stage would refuse (longer than any context) is not reached.
    _, key = server.new_tenant({"max_tokens_per_request": 10})
    model = server.state.model_id
    too_long = "x" * (server.state.prompts.max_prompt_chars + 1)
    r = _post(server, key, "/v1/completions", {"model": model, "prompt": ["hello"] * 63 + [too_long], "n": 16,
                                               "max_tokens": 10})
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_per_request", r.text
    assert "prompts 64 x n 16 x max_tokens" in r.json()["error"]["message"]
    # within the cap the same batch reaches the tokenizer stage and its refusal
    r = _post(server, key, "/v1/completions", {"model": model, "prompt": ["hello"] * 9 + [too_long],
                                               "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # and a batch of texts within every limit is encoded prompt by prompt, as one prompt alone is
    r = _post(server, key, "/v1/completions", {"model": model, "prompt": ["hello world", "hi"], "max_tokens": 1,
                                               "echo": True, "logprobs": 0})
    single = _post(server, key, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1, "echo": True,
                                                    "logprobs": 0})
    assert r.status_code == 200 and single.status_code == 200, (r.text, single.text)
    echoed = [c["logprobs"]["tokens"][:-1] for c in (r.json()["choices"][1], single.json()["choices"][0])]
    assert echoed[0] == echoed[1] and len(echoed[0]) > 1, echoed  # the prompt's tokens, the completion left out


def test_tokens_per_minute_admits_the_whole_request(server):
    _, key = server.new_tenant({"tokens_per_minute": 200})
    model = server.state.model_id
    r = _post(server, key, "/v1/completions", {"model": model, "prompt": ["hello"] * 64, "max_tokens": 16})
    assert r.status_code == 400 and r.json()["error"]["code"] == "tokens_per_minute", r.text
    usage = _usage(server, key)
    assert usage["total"]["requests"] == 0 and usage["current"]["requests_in_window"] == 0


def test_a_refused_batch_is_not_billed(server):
    name, key = server.new_tenant({"tokens_per_minute": 200})
    model = server.state.model_id
    r = _post(server, key, "/v1/completions", {"model": model, "prompt": [5, 6, 7], "max_tokens": 100,
                                               "ignore_eos": True})
    assert r.status_code == 200, r.text
    before = _usage(server, key)
    assert before["current"]["tokens_in_window"] == 103
    # 8 x (3 + 10) = 104 fits the limit alone, not on top of the 103 already in the window:
    # some prompts are admitted before one is refused, and all of them are undone
    r = _post(server, key, "/v1/completions", {"model": model, "prompt": [[5, 6, 7]] * 8, "max_tokens": 10})
    assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_per_minute", r.text
    # the usage keeper's next round (every 2 s) must not bill the refused prompts either
    server.state.settlements.record_progress()
    assert server.state.settlements.running == 0  # and their leases are no longer beaten
    after = _usage(server, key)
    assert after["total"] == before["total"]
    assert after["current"] == before["current"]
    # refused before the engine: a batch over the concurrency limit
    _, busy = server.new_tenant({"max_concurrent_requests": 2})
    r = _post(server, busy, "/v1/completions", {"model": model, "prompt": ["a", "b", "c"], "max_tokens": 1})
    assert r.status_code == 429, r.text
    usage = _usage(server, busy)
    assert usage["total"]["requests"] == 0 and usage["total"]["prompt_tokens"] == 0
    assert usage["current"]["requests_in_window"] == 0 and usage["current"]["concurrent_requests"] == 0


def test_echo_with_max_tokens_zero_returns_the_prompt(server):
    _, key = server.new_tenant()
    r = _post(server, key, "/v1/completions", {"model": server.state.model_id, "prompt": "Hello there",
                                               "max_tokens": 0, "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hello there" and choice["logprobs"] is None
    assert "prompt_logprobs" not in choice
    assert r.json()["usage"]["completion_tokens"] == 0


def test_patch_without_quota_is_a_400_naming_it(server):
    name, _ = server.new_tenant()
    r = server.admin("PATCH", f"/admin/tenants/{name}", json={})
    assert r.status_code == 400 and "quota" in r.json()["error"]["message"], r.text
    assert server.admin("PATCH", f"/admin/tenants/{name}", json={"quota": {"max_adapters": 3}}).status_code == 200


def test_405_lists_every_allowed_method(server):
    with server.http(server.config.admin_token) as h:
        r = h.put("/admin/tenants/someone")
        assert r.status_code == 405
        assert {m.strip() for m in r.headers["Allow"].split(",")} >= {"GET", "PATCH", "DELETE"}
        r = h.delete("/admin/tenants")
        assert r.status_code == 405
        assert {m.strip() for m in r.headers["Allow"].split(",")} >= {"GET", "POST"}


def test_admin_adapters_offset_range_agrees_with_its_message(server):
    r = server.admin("GET", "/admin/adapters", params={"offset": "1000000000"})
    assert r.status_code == 200 and r.json()["data"] == [], r.text
    r = server.admin("GET", "/admin/adapters", params={"offset": "1000000001"})
    assert r.status_code == 400 and "0..1000000000" in r.json()["error"]["message"], r.text
