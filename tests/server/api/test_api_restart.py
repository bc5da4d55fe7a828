"""A restart on the same Redis: tenants, keys and adapters are still there and served."""
from __future__ import annotations

from dataclasses import replace

from server.embedded_redis.server import free_port
from tests.fixtures_server import api_redis_url, running_server, server_config


def test_restart_keeps_tenants_keys_and_adapters(tiny_model_dir, tiny_adapters, redis_server, tmp_path, core_starter):
    config = server_config(tiny_model_dir, tmp_path, api_redis_url(redis_server))
    with running_server(config, starter=core_starter) as first:
        name, key = first.new_tenant({"requests_per_minute": 100})
        assert first.upload(key, "keep", tiny_adapters["r16_rslora"]).status_code == 201
        before = first.client(key).completions.create(model="keep", prompt="hello", max_tokens=6,
                                                      temperature=0).choices[0].text
    with running_server(replace(config, port=free_port()), starter=core_starter) as second:
        assert second.state.engine.stats().host.adapters == 0  # nothing carried over in memory
        c = second.client(key)
        assert [m.id for m in c.models.list().data] == [second.state.model_id, "keep"]
        after = c.completions.create(model="keep", prompt="hello", max_tokens=6, temperature=0)
        assert after.choices[0].text == before
        tenant = second.admin("GET", f"/admin/tenants/{name}").json()
        assert tenant["quota"]["requests_per_minute"] == 100 and tenant["adapters"] == 1
