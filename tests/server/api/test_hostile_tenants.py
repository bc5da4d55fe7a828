"""Tenant identity and operator credentials: a deleted tenant's data dies with it, /metrics does not
name customers to strangers, credentials survive restarts, a busy port fails before anything starts."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest

from adapters.registry import AdapterNotFound
from server.cli import build_parser
from server.config import ServerConfig
from server.credentials import ADMIN_TOKEN_FILE, DEMO_KEY_FILE
from server.embedded_redis.server import free_port
from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.repo import ROOT_DIR as ROOT



def test_a_new_tenant_with_an_old_name_starts_empty(tiny_model_dir, tiny_adapters, redis_server, tmp_path,
                                                    core_starter):
    config = server_config(tiny_model_dir, tmp_path, api_redis_url(redis_server), adapter_grace_seconds=0.0)
    with running_server(config, starter=core_starter) as server:
        state = server.state
        name, key = server.new_tenant(name="acme")
        r = server.upload(key, "secret-sauce", tiny_adapters["r8_all"])
        assert r.status_code == 201
        version = r.json()["version"]
        assert server.client(key).completions.create(model="secret-sauce", prompt="hi", max_tokens=2).usage
        old_id = state.tenants.get(name).id
        assert server.admin("DELETE", f"/admin/tenants/{name}").json()["adapters_retired"] == 1

        _, new_key = server.new_tenant(name="acme")
        new = state.tenants.get(name)
        assert new.id != old_id
        c = server.client(new_key)
        assert [m.id for m in c.models.list().data] == [state.model_id]  # not the old adapter
        with server.http(new_key) as h:
            assert h.post("/v1/completions", json={"model": "secret-sauce", "prompt": "hi"}).status_code == 404
            assert h.get("/v1/adapters").json()["data"] == []
            usage = h.get("/v1/usage").json()
        assert usage["total"] == {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "adapters": {}}
        assert usage["current"]["concurrent_requests"] == 0 and usage["current"]["adapters"] == 0
        with server.http(key) as h:
            assert h.get("/v1/models").status_code == 401  # the old key died with the old tenant
        # The old version left this engine's tiers and, past its grace (0 here), the store.
        state.registry.collect_garbage()
        assert state.registry.get_version(version) is None
        with pytest.raises(AdapterNotFound):
            state.registry.read_files(version)
        assert not state.tenants.pending_purges()


def test_metrics_need_a_credential(tiny_model_dir, redis_server, tmp_path, api_server, core_starter):
    name, key = api_server.new_tenant()
    api_server.client(key).completions.create(model=api_server.state.model_id, prompt="hi", max_tokens=1)
    with api_server.http() as h:
        r = h.get("/metrics")
        assert r.status_code == 401 and name not in r.text and r.headers["www-authenticate"] == "Bearer"
    with api_server.http(key) as h:
        assert h.get("/metrics").status_code == 403
    with api_server.http("not-the-token-" + "x" * 20) as h:
        assert h.get("/metrics").status_code == 401
    assert name in api_server.admin("GET", "/metrics").text

    metrics_token = "prometheus-scrape-token-0123456789"
    config = server_config(tiny_model_dir, tmp_path / "m", api_redis_url(redis_server, flush=False),
                           metrics_token=metrics_token)
    with running_server(config, starter=core_starter) as server:
        with server.http(metrics_token) as h:
            assert h.get("/metrics").status_code == 200
            assert h.get("/admin/tenants").status_code == 401  # only /metrics
    with running_server(replace(config, port=free_port(), metrics_public=True), starter=core_starter) as server:
        with server.http() as h:
            assert h.get("/metrics").status_code == 200


def _serve_args(data_dir: Path, *extra: str) -> Namespace:
    return build_parser().parse_args(["serve", "--data-dir", str(data_dir), *extra])


def test_generated_credentials_are_kept_and_reused(tiny_model_dir, redis_server, tmp_path, monkeypatch, core_starter):
    monkeypatch.delenv("LORAPLEX_ADMIN_TOKEN", raising=False)
    first = ServerConfig.from_args(_serve_args(tmp_path))
    second = ServerConfig.from_args(_serve_args(tmp_path))
    assert first.admin_token_generated and first.admin_token == second.admin_token
    token_file = tmp_path / ADMIN_TOKEN_FILE
    assert token_file.read_text().strip() == first.admin_token and token_file.stat().st_mode & 0o077 == 0
    given = ServerConfig.from_args(_serve_args(tmp_path, "--admin-token", "operator-token-0123456789"))
    assert given.admin_token == "operator-token-0123456789" and not given.admin_token_generated
    # A Redis URL with a password can come from the environment, out of `ps`.
    url = "redis://:secret@10.0.0.5:6379/0"
    assert ServerConfig.from_args(_serve_args(tmp_path), env={"LORAPLEX_REDIS_URL": url}).redis_url == url

    url = api_redis_url(redis_server)
    config = server_config(tiny_model_dir, tmp_path, url, demo_tenant=True)
    keys = []
    for _ in range(3):
        with running_server(replace(config, port=free_port()), starter=core_starter) as server:
            info = server.app.state.startup
            keys.append(info.demo_key)
            assert server.client(info.demo_key).models.list().data
            listed = server.admin("GET", "/admin/tenants/demo").json()["keys"]
    assert keys[0] == keys[1] == keys[2] and len(listed) == 1  # no new key per start
    key_file = tmp_path / DEMO_KEY_FILE
    assert key_file.read_text().strip() == keys[0] and key_file.stat().st_mode & 0o077 == 0
    # A revoked demo key is replaced by a working one at the next start.
    with running_server(replace(config, port=free_port()), starter=core_starter) as server:
        key_id = listed[0]["id"]
        assert server.admin("DELETE", f"/admin/tenants/demo/keys/{key_id}").status_code == 200
    with running_server(replace(config, port=free_port()), starter=core_starter) as server:
        fresh = server.app.state.startup.demo_key
        assert fresh != keys[0] and server.client(fresh).models.list().data


def test_a_busy_port_fails_at_once(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", str(port),
                               "--data-dir", str(tmp_path / "data")], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "LORAPLEX_ADMIN_TOKEN": "x" * 20})
    assert proc.returncode == 2 and f"127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
    assert time.monotonic() - start < 30
    assert not (tmp_path / "data" / "demo").exists()  # nothing was built, no credentials printed
    assert "token" not in proc.stdout
