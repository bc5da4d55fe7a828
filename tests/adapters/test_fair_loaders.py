"""Loader capacity shared fairly, through the real server (issue 43, finding 2): two tenants whose
remote sources drip hold the remote lane's loader processes, and a third tenant's cold load of a
local directory still finishes within a second (the near lane, the pager's process); and a source
that drips one byte just inside each read timeout is cut off at the fetch's total deadline."""
from __future__ import annotations

import threading
import time

import pytest

from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.source_servers import FileServer

FETCH_TIMEOUT = 4.0
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def files():
    with FileServer() as server:
        yield server


@pytest.fixture(scope="module")
def slow_drip():
    """One byte every 3 s: each read ends inside the 4 s timeout, so only a total deadline stops it."""
    with FileServer() as server:
        server.drip_interval = 3.0
        yield server


@pytest.fixture(scope="module")
def local_root(tmp_path_factory, tiny_adapters):
    root = tmp_path_factory.mktemp("fair-adapter-root")
    (root / "cold").mkdir()
    for f in FILES:
        (root / "cold" / f).write_bytes((tiny_adapters["r4_qv"] / f).read_bytes())
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, local_root, core_starter):
    config = server_config(
        tiny_model_dir, tmp_path_factory.mktemp("fair-loader-data"), api_redis_url(redis_server),
        max_upload_bytes=2 << 20, adapter_sources=("http", "local"), adapter_local_root=str(local_root),
        adapter_http_hosts=("127.0.0.1",), adapter_allow_private_networks=True,
        adapter_fetch_timeout=FETCH_TIMEOUT, adapter_load_workers=2, adapter_loads_per_tenant=2)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _load(server, key: str, name: str, path: str, out: dict) -> None:
    with server.http(key) as h:
        start = time.monotonic()
        out[name] = h.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        out[name + ".s"] = time.monotonic() - start


def test_a_cold_local_load_does_not_wait_behind_two_tenants_slow_sources(server, files):
    slow = [server.new_tenant()[1] for _ in range(2)]
    _, victim = server.new_tenant()
    out: dict = {}
    threads = []
    for i, key in enumerate(slow):
        for j in range(2):  # each asks for both processes (its cap allows 2 while alone)
            files.drip.add(f"/slow{i}{j}/adapter_config.json")
            threads.append(threading.Thread(target=_load, args=(server, key, f"s{i}{j}", f"{files.url}/slow{i}{j}/", out)))
    # One load of each tenant first (a tenant alone may take both slots), then their second ones.
    for t in threads[0::2]:
        t.start()
    deadline = time.monotonic() + 30
    while len(server.state.loaders.busy_pids()) < 2:
        assert time.monotonic() < deadline, "the slow loads never took both loader processes"
        time.sleep(0.02)
    for t in threads[1::2]:
        t.start()
    time.sleep(0.5)  # the second loads are in; each must wait for its own tenant's slot
    # Shared: each slow tenant holds one of the two remote slots, neither both.
    assert sorted(server.state.fetches.running.values()) == [1, 1], server.state.fetches.running
    _load(server, victim, "cold", "cold", out)
    assert out["cold"].status_code == 200, out["cold"].text
    print(f"cold local load under two slow tenants: {out['cold.s']:.3f} s")
    assert out["cold.s"] < 1.0, out["cold.s"]
    assert all(t.is_alive() for t in threads[:2]) or len(server.state.loaders.busy_pids()) == 2
    for t in threads:
        t.join(60)
    assert all(out[f"s{i}{j}"].status_code == 504 for i in range(2) for j in range(2))


def test_a_drip_inside_each_read_timeout_ends_at_the_total_deadline(server, slow_drip):
    _, key = server.new_tenant()
    slow_drip.drip.add("/drip/adapter_config.json")
    out: dict = {}
    _load(server, key, "drip", f"{slow_drip.url}/drip/", out)
    assert out["drip"].status_code == 504 and "timed out" in out["drip"].text, out["drip"].text
    print(f"drip ended after {out['drip.s']:.3f} s (fetch timeout {FETCH_TIMEOUT} s)")
    # Per-read timeouts alone end it at the first byte past the deadline: 6 s.
    assert FETCH_TIMEOUT - 0.1 <= out["drip.s"] < FETCH_TIMEOUT + 1.5, out["drip.s"]
