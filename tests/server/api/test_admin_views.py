"""The operator's endpoints through httpx against a real server and Redis: a tenant's usage (per day,
per adapter) and keys (last used, never the secret), every adapter with its residency, the engine's
live state; a tenant key gets 403 on each; / and /version."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tests.repo import ROOT_DIR as ROOT


ADMIN_VIEWS = ["/admin/tenants/{t}/usage", "/admin/tenants/{t}/refusals", "/admin/tenants/{t}/keys", "/admin/adapters",
               "/admin/engine"]

# /admin/engine's sections read from EngineStats, key by key.
STATS_SECTIONS = {
    "kv_blocks": ["total", "used"],
    "slots": ["draft_bytes", "evictions", "hit_rate", "hits", "max_lora_rank", "misses", "pages_total", "pages_used", "pinned",
              "total", "used"],
    "host": ["adapters", "budget_bytes", "bytes", "evictions", "hit_rate", "hits", "load_failures", "loads_in_flight",
             "misses", "parked", "parked_bytes"],
    "store": ["adapters", "bytes", "counted_at"],
    "prefix_cache": ["cached_blocks", "cached_free_blocks", "enabled", "hit_rate", "hit_tokens", "queried_tokens"],
    "cuda_graphs": ["capture_bytes", "capture_seconds", "enabled", "graphs", "replays"],
    "async_scheduling": ["enabled", "rows_discarded", "steps", "steps_ahead"],
    "structured_output": ["cache_hits", "cached_grammars", "compile_cold_starts", "compile_seconds",
                          "compile_timeouts", "compiles", "compiles_running", "constrained_requests", "failures"],
    "speculative_decoding": ["acceptance_rate", "accepted_per_position", "mean_accepted_length", "method",
                             "num_accepted_tokens", "num_draft_tokens", "num_drafts", "skipped_steps"],
}


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
    assert total["adapters"]["sql"]["completion_tokens"] == 3 and total["adapters"][api_server.state.model_id]["completion_tokens"] == 2
    assert "" not in total["adapters"]  # issue 42: the base model's usage under its id
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


def test_refusals_by_tenant_from_real_traffic(api_server):
    """Each refusal of an authenticated tenant is counted by reason: its 429s by the limit reached, its
    bad requests, unknown models and oversized requests; a bad key names no tenant and counts for none."""
    name, key = api_server.new_tenant({"requests_per_minute": 3, "max_tokens_per_request": 8})
    other, other_key = api_server.new_tenant()
    model = api_server.state.model_id
    with api_server.http(key) as h:
        codes = [h.post("/v1/completions", json=body).status_code for body in (
            {"model": model, "prompt": "hi", "max_tokens": 1},     # 200
            {"model": "no-such-adapter", "prompt": "hi", "max_tokens": 1},   # 404
            {"model": model, "prompt": "hi", "max_tokens": 9},     # 400: over max_tokens_per_request
            {"model": model, "prompt": "hi", "max_tokens": 1},     # 200: refusals are not in the window
            {"model": model, "prompt": "hi", "max_tokens": 1},     # 200
            {"model": model, "prompt": "hi", "max_tokens": 1},     # 429: the fourth in the minute
            {"model": model, "prompt": "hi", "max_tokens": 1})]    # 429
    assert codes == [200, 404, 400, 200, 200, 429, 429]
    with api_server.http("lp-notakey.nope") as h:
        assert h.get("/v1/models").status_code == 401
    got = api_server.admin("GET", f"/admin/tenants/{name}/refusals", params={"days": 2}).json()
    assert got["object"] == "refusals" and got["tenant"] == name and len(got["days"]) == 2
    expected = {"requests_per_minute": 2, "not_found": 1, "invalid_request": 1}
    assert got["total"] == {"refused": 4, "reasons": expected} and got["days"][-1]["reasons"] == expected
    assert api_server.admin("GET", f"/admin/tenants/{other}/refusals").json()["total"] == {"refused": 0, "reasons": {}}
    with api_server.http(other_key) as h:  # the tenant cannot read it
        assert h.get(f"/admin/tenants/{other}/refusals").status_code == 403
    assert api_server.admin("GET", f"/admin/tenants/{name}/refusals", params={"days": 91}).status_code == 400
    assert api_server.admin("GET", "/admin/tenants/nobody/refusals").status_code == 404


def test_the_operator_uploads_replaces_and_deletes_a_tenants_adapter(api_server, tiny_adapters):
    """/admin/tenants/{t}/adapters takes the tenant's own multipart form, under the tenant's quota."""
    name, key = api_server.new_tenant({"max_adapters": 1})

    def upload(adapter, kind, replace=False):
        d = tiny_adapters[kind]
        files = {f: (f, (d / f).read_bytes()) for f in ("adapter_config.json", "adapter_model.safetensors")}
        return api_server.admin("POST", f"/admin/tenants/{name}/adapters", files=files,
                                data={"name": adapter, "replace": "true" if replace else "false"})

    first = upload("ops", "r4_qv")
    assert first.status_code == 201 and first.json()["rank"] == 4
    assert upload("ops", "r4_qv").status_code == 409  # exists, no replace
    assert upload("second", "r4_qv").status_code == 403  # the tenant's max_adapters
    replaced = upload("ops", "r8_all", replace=True)
    assert replaced.status_code == 201 and replaced.json()["rank"] == 8
    assert replaced.json()["version"] != first.json()["version"]
    with api_server.http(key) as h:  # the tenant serves it under its own name
        assert h.get("/v1/adapters/ops").json()["rank"] == 8
    api_server.client(key).completions.create(model="ops", prompt="hi", max_tokens=1)
    assert api_server.admin("DELETE", f"/admin/tenants/{name}/adapters/ops").json()["deleted"] is True
    assert api_server.admin("DELETE", f"/admin/tenants/{name}/adapters/ops").status_code == 404
    with api_server.http(key) as h:
        assert h.get("/v1/adapters/ops").status_code == 404
        assert h.post(f"/admin/tenants/{name}/adapters", files={}, data={"name": "x"}).status_code == 403
    assert api_server.admin("POST", "/admin/tenants/nobody/adapters", data={"name": "x"}).status_code == 404


def test_engine_view_and_history(api_server):
    _, key = api_server.new_tenant()
    api_server.client(key).completions.create(model=api_server.state.model_id, prompt="hi", max_tokens=20,
                                              extra_body={"ignore_eos": True})
    view = api_server.admin("GET", "/admin/engine").json()
    assert view["healthy"] and view["kv_blocks"]["total"] == 64 and view["slots"]["total"] == 4
    # The view's shape is public (the console reads it); EngineStats nests differently.
    assert {k: sorted(v) for k, v in view.items() if k in STATS_SECTIONS} == STATS_SECTIONS
    assert {"healthy", "error", "running", "waiting", "preemptions", "kv_cache", "base_weights", "dora_scales",
            "engines", "history", "memory_pool"} | set(STATS_SECTIONS) == set(view)
    assert view["memory_pool"] is None  # no --unified-memory (tests/server/api/test_api_unified_memory.py)
    assert view["engines"] == []  # one engine: no per-core section (--data-parallel-size: test_api_data_parallel)
    assert view["kv_cache"] == {"dtype": "float32", "requested_dtype": "auto", "blocks": 64, "block_size": 16,
                                "tokens": 1024, "bytes": api_server.state.engine.info.kv_pool.bytes}
    # (That these bytes are the tensors' own: tests/server/engine/test_quantized_memory.py.)
    weights = api_server.state.engine.info.base_weights
    assert view["base_weights"] == {"projections": "float32", "int4_group_size": None, "lm_head": "float32",
                                    "projection_bytes": weights["projection_bytes"],
                                    "bytes_by_dtype": {"float32": weights["bytes"]}, "bytes": weights["bytes"]}
    assert view["base_weights"]["projection_bytes"] > 0
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
    icon = httpx.get(f"{api_server.url}/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml" and b"<svg" in icon.content
    page = httpx.get(f"{api_server.url}/admin/ui")
    assert page.status_code == 200 and "connect-src 'self'" in page.headers["content-security-policy"]
    out = subprocess.run([sys.executable, "-m", "server.cli", "--version"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and version["version"] in out.stdout


def test_every_response_carries_the_hardening_headers(api_server):
    """Pages: scripts and styles from this origin's files only, no inline code; everything else (JSON,
    errors, SSE): nothing may load. None may be framed, sniffed or leak a referrer."""
    base = api_server.url
    _, key = api_server.new_tenant()
    pages = {path: httpx.get(f"{base}{path}") for path in ("/", "/admin/ui", "/docs")}
    for path, page in pages.items():
        csp = dict(d.strip().split(" ", 1) for d in page.headers["content-security-policy"].split(";"))
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), path
        assert csp["script-src"] == "'self'" and csp["style-src"] == "'self'" and csp["default-src"] == "'none'"
        assert csp["frame-ancestors"] == "'none'" and csp["require-trusted-types-for"] == "'script'"
        assert "<script>" not in page.text and "<style>" not in page.text and " style=" not in page.text
        assert not re.search(r"\son[a-z]+=", page.text), f"an inline handler on {path}"
        for asset in re.findall(r'(?:src|href)="(/assets/[^"]+)"', page.text):
            served = httpx.get(f"{base}{asset}")
            kind = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}[Path(asset).suffix]
            assert served.status_code == 200 and served.headers["content-type"].startswith(kind), asset
    assert {"/assets/console.js", "/assets/console.css", "/assets/docs.js"} <= set(
        re.findall(r'"(/assets/[^"]+)"', pages["/admin/ui"].text + pages["/docs"].text))
    with api_server.http(key) as h:
        answers = [h.get("/v1/models"), h.get("/v1/adapters/nope"), httpx.get(f"{base}/health"),
                   httpx.get(f"{base}/v1/models"), httpx.get(f"{base}/assets/../console.py"),
                   httpx.get(f"{base}/assets/app.py")]
        with h.stream("POST", "/v1/completions", json={"model": api_server.state.model_id, "prompt": "hi",
                                                       "max_tokens": 2, "stream": True}) as sse:
            answers.append(sse)
    assert [r.status_code for r in answers] == [200, 404, 200, 401, 404, 404, 200]
    for r in [*pages.values(), *answers]:
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
        assert r.headers["referrer-policy"] == "no-referrer"
    for r in answers:
        assert r.headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'"


def test_the_mismatches_schemathesis_found_stay_fixed(api_server):
    """A 405 names every method of its path; the published bounds are the enforced ones; a quota is a JSON
    number; PATCH takes what its published schema says (wrapped or unwrapped, not {})."""
    base = api_server.url
    admin = {"Authorization": f"Bearer {api_server.config.admin_token}"}
    name, key = api_server.new_tenant()
    for path, methods in ((f"/admin/tenants/{name}", "DELETE, GET, HEAD, PATCH"), ("/admin/tenants", "GET, HEAD, POST"),
                          ("/v1/adapters/x", "DELETE, GET, HEAD"), (f"/admin/tenants/{name}/keys", "GET, HEAD, POST")):
        r = httpx.request("OPTIONS", f"{base}{path}", headers=admin)
        assert r.status_code == 405 and r.headers["allow"] == methods, path
    doc = httpx.get(f"{base}/openapi.json").json()
    offset = next(p for p in doc["paths"]["/admin/adapters"]["get"]["parameters"] if p["name"] == "offset")
    top = offset["schema"]["maximum"]
    assert httpx.get(f"{base}/admin/adapters", params={"offset": top}, headers=admin).status_code == 200
    assert httpx.get(f"{base}/admin/adapters", params={"offset": top + 1}, headers=admin).status_code == 400
    vocab = api_server.state.engine.info.vocab_size
    assert doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    for bad in ("5", True):
        r = httpx.post(f"{base}/admin/tenants", json={"name": "typed-quota", "quota": {"max_adapters": bad}},
                       headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == "quota.max_adapters"
    r = httpx.patch(f"{base}/admin/tenants/{name}", json={}, headers=admin)
    assert r.status_code == 400 and "quota" in r.json()["error"]["message"]
    assert doc["components"]["schemas"]["TenantPatchBody"]["minProperties"] == 1
    for body, rpm in (({"requests_per_minute": 7}, 7), ({"quota": {"requests_per_minute": 9}}, 9)):
        r = httpx.patch(f"{base}/admin/tenants/{name}", json=body, headers=admin)
        assert r.status_code == 200 and r.json()["quota"]["requests_per_minute"] == rpm
    assert httpx.patch(f"{base}/admin/tenants/{name}", json={"quota": {}, "weight": 2}, headers=admin).status_code == 400
