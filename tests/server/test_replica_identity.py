"""Replica identity: --replica-name (default hostname:port) in /health, /version, the
x-loraplex-replica header on every response (streams not buffered) and /metrics."""
from __future__ import annotations

import socket
import time
from dataclasses import replace
from importlib import metadata

import httpx
import pytest
import torch
import transformers
import triton

from server.cli import build_parser
from server.config import ConfigError, ServerConfig
from server.version import package_version
from tests.fixtures_server import api_redis_url, running_server, server_config

NAME = "replica-a.test:1"


@pytest.fixture(scope="module")
def named_server(tmp_path_factory, tiny_model_dir, redis_server):
    # In-process: the unbuffered-stream test slows the engine with engine_throttled, which holds an
    # in-process engine to a step per nap but not an engine core (it steps on while each nap's reply
    # crosses the socket: 60 tokens in under 1 s); the replica headers are the front end's either way.
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("replica-data"),
                           api_redis_url(redis_server), replica_name=NAME, engine_process="in-process")
    with running_server(config) as handle:
        yield handle


def test_default_name_is_hostname_and_port(tmp_path):
    config = ServerConfig(data_dir=tmp_path, admin_token="x" * 16, port=8123)
    assert config.replica.endswith(":8123")
    assert config.replica.split(":")[0] in socket.gethostname()
    # Derived, not stored: a copy on another port is named after that port.
    assert replace(config, port=9000).replica.endswith(":9000")
    assert replace(config, replica_name="r1").replica == "r1"


@pytest.mark.parametrize("bad", ["", "has space", "ünïcode", "new\nline", "-lead", "x" * 129])
def test_bad_names_are_refused(tmp_path, bad):
    with pytest.raises(ConfigError, match="--replica-name"):
        ServerConfig(data_dir=tmp_path, admin_token="x" * 16, replica_name=bad)


def test_cli_flag():
    args = build_parser().parse_args(["serve", "--replica-name", "gpu-node-3"])
    assert args.replica_name == "gpu-node-3"
    assert build_parser().parse_args(["serve"]).replica_name is None


def test_health_and_version_name_the_replica(named_server):
    with named_server.http() as c:
        health = c.get("/health")
        version = c.get("/version")
    assert health.status_code == 200 and health.json()["replica"] == NAME
    assert version.status_code == 200
    body = version.json()
    assert body["replica"] == NAME and body["model"] == named_server.state.model_id
    assert body["version"] == metadata.version("loraplex") and body["torch"] == torch.__version__
    assert body["transformers"] == transformers.__version__ and body["triton"] == triton.__version__
    assert body["device"] == "cpu" and body["dtype"] == "float32"
    assert health.headers["x-loraplex-replica"] == NAME and version.headers["x-loraplex-replica"] == NAME


def test_health_reads_the_installed_version_once_not_per_poll(named_server):
    # Reading a distribution's metadata costs ~2 ms of CPU on the event loop: a /health poller must
    # not pay it (nor make every other request wait for it) on each call.
    with named_server.http() as c:
        c.get("/health")
        before = package_version.cache_info()
        versions = {c.get("/health").json()["version"] for _ in range(5)}
    after = package_version.cache_info()
    assert versions == {metadata.version("loraplex")}
    assert after.misses == before.misses and after.hits >= before.hits + 5


def test_header_on_errors_and_tenant_routes(named_server):
    _, key = named_server.new_tenant()
    with named_server.http() as anon, named_server.http(key) as c:
        responses = [anon.get("/v1/models"), anon.get("/no/such/route"), c.get("/v1/models"),
                     c.post("/v1/completions", json={"model": "nope", "prompt": "x"}),
                     c.post("/v1/completions", json={"model": named_server.state.model_id,
                                                     "prompt": "hello", "max_tokens": 2})]
    assert [r.status_code for r in responses] == [401, 404, 200, 404, 200]
    assert all(r.headers.get("x-loraplex-replica") == NAME for r in responses)
    assert all(len(r.headers.get_list("x-loraplex-replica")) == 1 for r in responses)


def test_stream_is_named_and_not_buffered(named_server):
    """With the engine slowed to ~50 steps/s, events must arrive spread over the generation,
    not together at its end."""
    _, key = named_server.new_tenant()
    body = {"model": named_server.state.model_id, "prompt": "hi", "max_tokens": 60, "ignore_eos": True,
            "stream": True}
    arrivals = []
    with named_server.http(key) as c, named_server.engine_throttled():
        start = time.monotonic()
        with c.stream("POST", "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200 and r.headers["x-loraplex-replica"] == NAME
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic() - start, line))
    assert arrivals[-1][1] == "data: [DONE]" and len(arrivals) >= 30
    first, last = arrivals[0][0], arrivals[-1][0]
    assert last > 1.0 and first < last / 3, (first, last)


def test_metrics_info_metric(named_server):
    with named_server.http(named_server.config.admin_token) as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["x-loraplex-replica"] == NAME
    line = next(ln for ln in r.text.splitlines() if ln.startswith("loraplex_replica_info{"))
    assert f'replica="{NAME}"' in line and f'model="{named_server.state.model_id}"' in line
    assert line.endswith(" 1.0")
    with httpx.Client(base_url=named_server.url) as anon:
        assert anon.get("/metrics").status_code == 401
