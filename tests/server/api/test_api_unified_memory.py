"""--unified-memory through the server: /admin/engine's memory_pool and /metrics' loraplex_memory_pool_units
report the pool's split (KV, adapter pages, cached prefix blocks, free) as the engine holds it, whichever
engine process serves (the pool's description crosses the engine-core transport in EngineInfo)."""
from __future__ import annotations

import re

import pytest

from tests.fixtures_server import api_redis_url, running_server, server_config


@pytest.fixture(scope="module")
def unified_server(tmp_path_factory, tiny_model_dir, tiny_adapters, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("unified-data"), api_redis_url(redis_server),
                           lora_page_rows=8, unified_memory=True,
                           adapters=(("acme", "first", str(tiny_adapters["r8_all"])),))
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _units(metrics: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r'^loraplex_memory_pool_units\{use="(\w+)"\} (\S+)$', metrics,
                                                   re.MULTILINE)}


def test_pool_split_in_admin_engine_and_metrics(unified_server):
    pool = unified_server.admin("GET", "/admin/engine").json()["memory_pool"]
    # 64 KV blocks and 4 rank-32 slots' worth of rank-8 pages (16), each page a whole number of blocks.
    assert pool["kv_share"] == 64 and pool["adapter_share"] == 16 * pool["units_per_page"]
    assert pool["units"] == 64 + pool["adapter_share"] and pool["adapter_units"] == pool["kv_units"] == 0
    key = unified_server.admin("POST", "/admin/tenants/acme/keys").json()["key"]
    with unified_server.http(key) as h:
        r = h.post("/v1/completions", json={"model": "first", "prompt": "hello there", "max_tokens": 3})
        assert r.status_code == 200, r.text
    view = unified_server.admin("GET", "/admin/engine").json()
    pool = view["memory_pool"]
    # The rank-8 adapter stays resident, idle: one page; its request's blocks are free (or cached) again.
    assert pool["adapter_units"] == pool["units_per_page"] and pool["kv_units"] == 0
    assert pool["kv_units"] + pool["adapter_units"] + pool["cached_free_units"] + pool["free_units"] == pool["units"]
    assert view["kv_blocks"] == {"used": 0, "total": pool["units"]} and view["slots"]["pages_used"] == 1
    units = _units(unified_server.admin("GET", "/metrics").text)
    assert units == {"kv": 0, "adapter": pool["adapter_units"], "cached": pool["cached_free_units"],
                     "free": pool["free_units"]}
