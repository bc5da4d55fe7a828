"""The operator's endpoints through httpx against a real server and Redis: a tenant's usage (per day,
per adapter) and keys (last used, never the secret), every adapter with its residency, the engine's
live state; a tenant key gets 403 on each; / and /version."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent

ADMIN_VIEWS = ["/admin/tenants/{t}/usage", "/admin/tenants/{t}/keys", "/admin/adapters", "/admin/engine"]


def test_tenant_usage_and_keys(api_server, tiny_adapters):
    name, key = api_server.new_tenant()
    assert api_server.upload(key, "sql", tiny_adapters["r4_qv"]).status_code == 201
    c = api_server.client(key)
    c.completions.create(model="sql", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    c.completions.create(model=api_server.state.model_id, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    usage = api_server.admin("GET", f"/admin/tenants/{name}/usage", params={"days": 3}).json()
    assert [d["date"] for d in usage["days"]] == sorted(d["date"] for d in usage["days"]) and len(usage["days"]) == 3
    total = usage["total"]
    assert total["requests"] == 2 and total["completion_tokens"] == 5
    assert total["adapters"]["sql"]["completion_tokens"] == 3 and total["adapters"][""]["completion_tokens"] == 2
    assert usage["current"]["adapters"] == 1
    with api_server.http(key) as h:  # the same numbers the tenant sees
        assert h.get("/v1/usage", params={"days": 3}).json()["total"] == total
    keys = api_server.admin("GET", f"/admin/tenants/{name}/keys").json()["data"]
    assert len(keys) == 1 and set(keys[0]) == {"id", "created_at", "last_used_at"}
    assert keys[0]["last_used_at"] is not None and keys[0]["last_used_at"] >= keys[0]["created_at"]
    assert key.split(".")[1] not in str(keys)  # never the secret
    assert api_server.admin("GET", "/admin/tenants/nobody/usage").status_code == 404
    assert api_server.admin("GET", f"/admin/tenants/{name}/usage", params={"days": "9" * 500}).status_code == 400


def test_adapters_with_residency(api_server, tiny_adapters):
    a_name, a_key = api_server.new_tenant()
    _, b_key = api_server.new_tenant()
    for i in range(3):
        assert api_server.upload(a_key, f"a{i}", tiny_adapters["r4_qv"]).status_code == 201
    version = api_server.upload(b_key, "b0", tiny_adapters["r8_all"]).json()["version"]

    def row(v):
        for offset in range(0, 10_000, 500):
            page = api_server.admin("GET", "/admin/adapters", params={"limit": 500, "offset": offset}).json()
            hit = [r for r in page["data"] if r["version"] == v]
            if hit or offset + 500 >= page["total"]:
                return hit[0] if hit else None
        return None

    assert row(version)["residency"] == "redis"  # uploaded, never used on this replica
    api_server.client(b_key).completions.create(model="b0", prompt="hi", max_tokens=2)
    assert row(version)["residency"] == "device"  # now in an adapter slot
    mine = api_server.admin("GET", "/admin/adapters", params={"tenant": a_name}).json()
    assert mine["total"] == 3 and {r["name"] for r in mine["data"]} == {"a0", "a1", "a2"}
    assert all(r["tenant"] == a_name for r in mine["data"])
    paged = api_server.admin("GET", "/admin/adapters", params={"tenant": a_name, "limit": 2, "offset": 2}).json()
    assert len(paged["data"]) == 1 and paged["total"] == 3
    assert api_server.admin("GET", "/admin/adapters", params={"limit": 0}).status_code == 400


def test_engine_view_and_history(api_server):
    _, key = api_server.new_tenant()
    api_server.client(key).completions.create(model=api_server.state.model_id, prompt="hi", max_tokens=20,
                                              extra_body={"ignore_eos": True})
    view = api_server.admin("GET", "/admin/engine").json()
    assert view["healthy"] and view["kv_blocks"]["total"] == 64 and view["slots"]["total"] == 4
    # A CPU device captures no CUDA graph (issue 21): every step eager, none replayed.
    assert view["cuda_graphs"] == {"enabled": False, "graphs": 0, "replays": 0, "capture_seconds": 0.0,
                                   "capture_bytes": 0}
    history = api_server.state.history
    point = history.sample(api_server.state.engine.stats())
    assert point["kv_blocks_total"] == 64 and point["tokens_per_s"] >= 0
    assert api_server.admin("GET", "/admin/engine").json()["history"][-1]["t"] == pytest.approx(point["t"])


@pytest.mark.parametrize("path", ADMIN_VIEWS + ["/admin/tenants", "/metrics"])
def test_a_tenant_key_is_403_on_every_admin_view(api_server, path):
    name, key = api_server.new_tenant()
    with api_server.http(key) as h:
        r = h.get(path.format(t=name))
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    with api_server.http() as h:
        assert h.get(path.format(t=name)).status_code == 401


def test_version_health_landing_and_cli(api_server):
    version = httpx.get(f"{api_server.url}/version").json()
    assert version["version"] and version["torch"] and version["transformers"] and version["model"]
    health = httpx.get(f"{api_server.url}/health").json()
    assert health["version"] == version["version"]
    landing = httpx.get(f"{api_server.url}/")
    assert landing.status_code == 200 and "/admin/ui" in landing.text and "/docs" in landing.text
    page = httpx.get(f"{api_server.url}/admin/ui")
    assert page.status_code == 200 and "connect-src 'self'" in page.headers["content-security-policy"]
    out = subprocess.run([sys.executable, "-m", "server.cli", "--version"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and version["version"] in out.stdout
