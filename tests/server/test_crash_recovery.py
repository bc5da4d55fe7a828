"""A replica that dies: its tenants' concurrency slots come back within --lease-ttl while a live
replica's long request keeps its own; usage of running requests is recorded as they run, so a
kill -9 loses at most --usage-settle-interval of it; normal requests' usage stays exact. Real
servers on the session's redis-server: two in-process replicas, and a `loraplex serve` child
process for the kill -9."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import httpx
import redis

from server.bench.server_proc import ServerProcess
from server.demo import make_base_model
from server.embedded_redis.server import free_port
from tenants import TenantStore, UsageLog
from tests.fixtures_server import api_redis_url, running_server, server_config

LEASE_TTL = 3.0
TOKENS = 300  # the recorded-as-it-runs test's stream: long enough to still run when it looks


def _stream(url: str, key: str, model: str, max_tokens: int, into: list, **extra) -> threading.Thread:
    """A streaming completion read in the background; `into` gets (arrival time, tokens) per event,
    then ("end", error or None)."""

    def run() -> None:
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "logprobs": 0, **extra}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        logprobs = event["choices"][0]["logprobs"] if event["choices"] else None
                        if logprobs:
                            into.append((time.monotonic(), len(logprobs["tokens"])))
            into.append(("end", None))
        except Exception as e:  # noqa: BLE001 - the test judges it
            into.append(("end", e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _complete(url: str, key: str, model: str, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0})


def _wait(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_a_silent_replicas_leases_are_reclaimed_and_a_live_ones_kept(tiny_model_dir, redis_server, tmp_path):
    # In-process: y's request must outlast two lease TTLs under engine_throttled, which holds an in-process
    # engine to a step per nap; an engine core steps on while each nap's reply crosses the socket (200
    # tokens in 2.5 s at a 0.1 s nap), and the leases under test are the front end's either way.
    config = server_config(tiny_model_dir, tmp_path / "a", api_redis_url(redis_server), lease_ttl=LEASE_TTL,
                           engine_process="in-process")
    with running_server(config) as live, \
            running_server(replace(config, port=free_port(), data_dir=tmp_path / "b")) as doomed:
        model = live.state.model_id
        x_name, x_key = live.new_tenant({"max_concurrent_requests": 2})
        y_name, y_key = live.new_tenant({"max_concurrent_requests": 1})
        x = live.state.tenants.get(x_name)
        events: list = []
        with doomed.engine_paused():
            # Two of x's requests on the doomed replica, held mid-flight; then it falls silent.
            held = [_stream(doomed.url, x_key, model, 4, events) for _ in range(2)]
            _wait(lambda: live.state.limiter.current(x)["concurrent_requests"] == 2)
            first = _complete(live.url, x_key, model)
            assert first.status_code == 429 and first.json()["error"]["code"] == "max_concurrent_requests"
            doomed.state.settlements.stop()
            silent_at = time.monotonic()
            # y's long request on the live replica: slowed to about 20 steps a second.
            y_events: list = []
            with live.engine_throttled(0.05):
                y_long = _stream(live.url, y_key, model, 200, y_events)
                _wait(lambda: bool(y_events))
                while (r := _complete(live.url, x_key, model)).status_code == 429:
                    assert time.monotonic() - silent_at < LEASE_TTL + 2, "x's slots never came back"
                    time.sleep(0.1)
                assert r.status_code == 200, r.text
                admitted_after = time.monotonic() - silent_at
                # y's own second request is refused for as long as its long request runs.
                probes = []
                while y_long.is_alive():
                    probes.append((time.monotonic(), _complete(live.url, y_key, model).status_code))
                    time.sleep(0.2)
                last_token_at = y_events[-2][0]
                ran_for = last_token_at - y_events[0][0]
        for thread in held:
            thread.join(30)
    assert y_events[-1] == ("end", None) and sum(n for _, n in y_events[:-1]) == 200
    assert ran_for > 2 * LEASE_TTL, f"y's request ran only {ran_for:.1f} s: too short to show the lease kept"
    # Probes sent well before its last token (the release follows that token closely).
    during = [code for at, code in probes if at < last_token_at - 0.5]
    assert len(during) > 10 and set(during) == {429}, probes
    assert admitted_after <= LEASE_TTL + 2
    assert live.state.settlements.leases_lost == 0


def test_running_requests_usage_is_recorded_as_they_run_and_stays_exact(tiny_model_dir, redis_server,
                                                                         tmp_path):
    config = server_config(tiny_model_dir, tmp_path, api_redis_url(redis_server), usage_settle_interval=0.2)
    with running_server(config) as server:
        name, key = server.new_tenant()
        model = server.state.model_id
        events: list = []
        with server.http(key) as h:
            with server.engine_throttled(0.05):
                stream = _stream(server.url, key, model, TOKENS, events)
                _wait(lambda: len(events) >= 3)
                # Recorded while it runs: the request, its prompt and some of its tokens. Looked at paused: a
                # loaded machine that starved the throttle's thread once let the stream end before the look.
                _wait(lambda: h.get("/v1/usage").json()["total"]["completion_tokens"] > 0)
                with server.engine_paused():
                    mid = h.get("/v1/usage").json()["total"]
                    assert server.state.engine.stats().scheduler.running == 1
            assert mid["requests"] == 1 and mid["prompt_tokens"] == 3 and 0 < mid["completion_tokens"] < TOKENS
            stream.join(60)
        assert events[-1] == ("end", None)
        # Normal requests, streaming or not, across many settle rounds: exact, nothing counted twice.
        out = server.client(key).completions.create(model=model, prompt="hello", max_tokens=30, temperature=0)
        with server.http(key) as h:
            total = h.get("/v1/usage").json()["total"]
        assert total["requests"] == 2
        assert total["prompt_tokens"] == 3 + out.usage.prompt_tokens
        assert total["completion_tokens"] == TOKENS + out.usage.completion_tokens
        assert server.state.settlements.running == 0


def test_a_killed_replica_loses_at_most_the_settle_interval_of_usage(redis_server, tmp_path):
    """kill -9 of a real `loraplex serve` mid-stream: the usage recorded equals the tokens the
    client received, less at most what one settle interval (plus scheduling slack) produced."""
    interval = 0.5
    url = api_redis_url(redis_server)
    # The tiny model with a long context: a fast CPU streamed 1000 tokens in 1.3 s, before the kill; 8000 take long enough.
    model_dir = make_base_model(tmp_path / "model", "llama", hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=128, max_position_embeddings=8192)
    serve_args = ["--redis-url", url, "--device", "cpu", "--kv-cache-blocks", "520", "--max-model-len", "8192",
                  "--usage-settle-interval", str(interval), "--model", str(model_dir)]
    with ServerProcess(tmp_path / "data", tmp_path / "serve.log", model_dir=None, serve_args=serve_args) as srv:
        admin = {"Authorization": f"Bearer {srv.admin_token}"}
        assert httpx.post(f"{srv.url}/admin/tenants", headers=admin, timeout=30,
                          json={"name": "crash", "quota": {}}).status_code == 201
        key = httpx.post(f"{srv.url}/admin/tenants/crash/keys", headers=admin, timeout=30).json()["key"]
        model = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                          timeout=30).json()["data"][0]["id"]
        events: list = []
        stream = _stream(srv.url, key, model, 8000, events)
        _wait(lambda: bool(events))
        started = events[0][0]
        _wait(lambda: events[-1][0] == "end" or events[-1][0] - started > 3 * interval + 1)
        assert events[-1][0] != "end", "the request finished before the kill: make it longer"
        srv.proc.kill()
        killed_at = time.monotonic()
        srv.proc.wait(10)
        stream.join(30)
    arrived = [(t, n) for t, n in events if t != "end"]
    delivered = sum(n for _, n in arrived)
    # Recorded at least what had arrived a settle interval (plus slack) before the kill.
    floor = sum(n for t, n in arrived if t <= killed_at - interval - 1.0)
    with redis.Redis.from_url(url) as client:
        usage = UsageLog(client).get(TenantStore(client).get("crash"))["total"]
    assert usage["requests"] == 1 and usage["prompt_tokens"] == 3
    assert floor > 0 and floor <= usage["completion_tokens"] <= delivered + 16, (floor, usage, delivered)

