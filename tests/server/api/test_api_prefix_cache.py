"""Prefix caching through the HTTP API: a repeated prompt reports cached tokens and answers the same;
another tenant, another cache_salt or a replaced adapter gets no hit; metrics and the admin view count
it; --no-enable-prefix-caching turns it off; --share-base-prefix-cache never tells a tenant what another
sent, nor lets one reach another's salted blocks."""
from __future__ import annotations

from dataclasses import replace

from server.embedded_redis.server import free_port
from tests.fixtures_server import api_redis_url, running_server, server_config

PROMPT = list(range(20, 120))  # 100 tokens: six full 16-token blocks


def _complete(server, key: str, model: str, **extra) -> tuple[str, int]:
    r = server.client(key).completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True, **extra})
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def test_hits_stay_inside_tenant_salt_and_adapter_version(api_server, tiny_adapters):
    state = api_server.state
    base = state.model_id
    _, a = api_server.new_tenant()
    _, b = api_server.new_tenant()
    text, cached = _complete(api_server, a, base)
    assert cached == 0
    before = state.engine.stats().prefix_cache.hit_tokens
    again, cached = _complete(api_server, a, base)
    assert again == text and cached == 96  # every full block but the one holding the last token
    assert state.engine.stats().prefix_cache.hit_tokens == before + 96
    assert _complete(api_server, b, base) == (text, 0)  # same tokens, another tenant: no hit
    assert _complete(api_server, a, base, cache_salt="s1") == (text, 0)  # a salt partitions within a tenant
    assert _complete(api_server, a, base, cache_salt="s1") == (text, 96)

    assert api_server.upload(a, "ad", tiny_adapters["r8_all"]).status_code == 201
    first, cached = _complete(api_server, a, "ad")
    assert cached == 0 and first != text
    assert _complete(api_server, a, "ad") == (first, 96)
    # Replaced under the same name: the old version's blocks are never reused.
    assert api_server.upload(a, "ad", tiny_adapters["r16_rslora"], replace=True).status_code == 201
    replaced, cached = _complete(api_server, a, "ad")
    assert cached == 0 and replaced != first

    metrics = api_server.admin("GET", "/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("loraplex_prefix_cache_hits_tokens ")]
    assert hits and float(hits[0].split()[-1]) >= 3 * 96
    view = api_server.admin("GET", "/admin/engine").json()["prefix_cache"]
    assert view["enabled"] and 0 < view["hit_rate"] < 1


def test_chat_reports_cached_tokens(api_server):
    _, key = api_server.new_tenant()
    messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "hi"}]
    c = api_server.client(key)
    first = c.chat.completions.create(model=api_server.state.model_id, messages=messages, max_tokens=4,
                                      temperature=0)
    second = c.chat.completions.create(model=api_server.state.model_id, messages=messages, max_tokens=4,
                                       temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.choices[0].message.content == first.choices[0].message.content


def test_caching_can_be_turned_off(tiny_model_dir, redis_server, tmp_path, core_starter):
    config = server_config(tiny_model_dir, tmp_path, api_redis_url(redis_server, flush=False),
                           enable_prefix_caching=False)
    with running_server(replace(config, port=free_port()), starter=core_starter) as server:
        _, key = server.new_tenant()
        model = server.state.model_id
        assert _complete(server, key, model)[1] == 0
        assert _complete(server, key, model)[1] == 0
        assert server.admin("GET", "/admin/engine").json()["prefix_cache"]["enabled"] is False


def test_share_base_tells_no_tenant_what_another_sent(tiny_model_dir, redis_server, tmp_path, core_starter):
    config = server_config(tiny_model_dir, tmp_path, api_redis_url(redis_server, flush=False),
                           share_base_prefix_cache=True)
    with running_server(replace(config, port=free_port()), starter=core_starter) as server:
        engine, model = server.state.engine, server.state.model_id
        _, a = server.new_tenant()
        _, b = server.new_tenant()
        text, _ = _complete(server, a, model)
        hits = engine.stats().prefix_cache.hit_tokens
        # B's first copy of A's prompt reuses A's KV (the point of the option) but reports nothing,
        # exactly as if A had never sent it; B's second copy reports what B itself sent.
        assert _complete(server, b, model) == (text, 0)
        assert engine.stats().prefix_cache.hit_tokens == hits + 96
        assert _complete(server, b, model) == (text, 96)

        # A salt is the tenant's own: B sending A's salt string reaches none of A's salted blocks.
        assert _complete(server, a, model, cache_salt="a-secret") == (text, 0)
        assert _complete(server, a, model, cache_salt="a-secret") == (text, 96)
        hits = engine.stats().prefix_cache.hit_tokens
        assert _complete(server, b, model, cache_salt="a-secret") == (text, 0)
        assert engine.stats().prefix_cache.hit_tokens == hits
