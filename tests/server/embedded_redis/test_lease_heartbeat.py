"""The lease heartbeat keeps time however many requests run: recording their usage (which grows with
their number) must not delay it. Before, one thread did both, one Redis round trip per running
request, so a heartbeat came late by (running requests x round trip) and under load 48 running
requests lost their leases at once while Redis was fine; their tenant could then exceed its
max_concurrent_requests. Real server, real redis-server; a proxy in its own process puts Redis 40 ms
away, so 64 running requests cost the old keeper ~2.6 s a round against a 2 s lease."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.embedded_redis.server import free_port
from tests.fixtures_server import API_DB, api_redis_url, running_server, server_config
from tests.repo import ROOT_DIR

LEASE_TTL = 2.0
REDIS_DELAY_MS = 40
STREAMS = 64
PROBE_WINDOW_S = 3 * LEASE_TTL


@pytest.fixture
def distant_redis_url(redis_server) -> Iterator[str]:
    """The session's redis-server, REDIS_DELAY_MS away."""
    api_redis_url(redis_server)  # flushed
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "tests.latency_proxy", str(port), str(redis_server.port),
                              str(REDIS_DELAY_MS)], cwd=ROOT_DIR,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout.readline().strip() == "ready"
        yield redis_server.url_for(API_DB).replace(f":{redis_server.port}/", f":{port}/")
    finally:
        proxy.kill()
        proxy.wait(10)


async def _hold_streams(url: str, key: str, model: str, stop: threading.Event, tokens: list) -> None:
    """len(tokens) long streaming completions, read until `stop`; tokens[i] counts stream i's tokens so far.
    One thread for all of them: a thread per stream (64 beside the in-process server's) made the server's
    heartbeat thread wait seconds for the GIL on a loaded machine, a gap no deployment has."""
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "temperature": 0,
            "stream": True, "logprobs": 0}

    async def one(client: httpx.AsyncClient, index: int) -> None:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if stop.is_set():
                    return
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    if choices and choices[0]["logprobs"]:
                        tokens[index] += len(choices[0]["logprobs"]["tokens"])

    limits = httpx.Limits(max_connections=len(tokens), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(one(client, i) for i in range(len(tokens))))


def test_many_running_requests_keep_their_leases_with_redis_a_round_trip_away(tiny_model_dir, distant_redis_url,
                                                                                 tmp_path, core_starter):
    config = server_config(tiny_model_dir, tmp_path, distant_redis_url, lease_ttl=LEASE_TTL,
                           usage_settle_interval=0.1, kv_cache_blocks=2560,
                           max_num_seqs=STREAMS + 8)  # a probe wrongly admitted runs at once
    with running_server(config, starter=core_starter) as server:
        model = server.state.model_id
        name, key = server.new_tenant({"max_concurrent_requests": STREAMS})
        stop = threading.Event()
        tokens = [0] * STREAMS
        probes: list[tuple[int, str | None]] = []
        # 500 tokens must outlast the streams' start and the probe window: an engine core steps 2-3 times per
        # pause (engine_throttled), so 0.1 s gives it 15-25 s, in-process 50 s.
        with server.engine_throttled(0.1):
            holder = threading.Thread(target=asyncio.run, args=(_hold_streams(server.url, key, model, stop, tokens),),
                                      daemon=True)
            holder.start()
            deadline = time.monotonic() + 60
            while min(tokens) == 0:
                assert time.monotonic() < deadline, f"streams never all started: {tokens}"
                time.sleep(0.1)
            # The tenant is at its limit for the whole window: every further request must be refused,
            # which it is only while the running requests' leases are alive.
            with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
                beats_before = server.state.settlements.beats
                window_ends = time.monotonic() + PROBE_WINDOW_S
                while time.monotonic() < window_ends:
                    r = c.post("/v1/completions", json={"model": model, "prompt": [5], "max_tokens": 1})
                    probes.append((r.status_code, r.json().get("error", {}).get("code")
                                   if r.status_code != 200 else None))
                    time.sleep(0.1)
            still_running = server.state.settlements.running
            beats = server.state.settlements.beats - beats_before
            stop.set()
            holder.join(60)
        deadline = time.monotonic() + 30
        while server.state.settlements.running:
            assert time.monotonic() < deadline, "the streams' requests were never settled"
            time.sleep(0.1)
        settlements = server.state.settlements
        assert still_running == STREAMS and min(tokens) > 0 and max(tokens) < 500, (still_running, tokens)
        assert len(probes) >= 5 and set(probes) == {(429, "max_concurrent_requests")}, probes
        assert settlements.leases_lost == 0
        # Beats kept time: one is due every lease / 3, so 9 in the window (the keeper that also recorded usage
        # managed ~2), and their longest silence was inside the lease.
        assert beats >= PROBE_WINDOW_S / settlements.beat_interval - 3, beats
        assert settlements.longest_beat_gap < LEASE_TTL, settlements.longest_beat_gap
        scraped = {line.partition(" ")[0]: float(line.partition(" ")[2])
                   for line in server.admin("GET", "/metrics").text.splitlines() if line.startswith("loraplex_lea")}
        assert scraped["loraplex_leases_lost"] == 0
        assert 0 < scraped["loraplex_lease_heartbeat_longest_gap_seconds"] < LEASE_TTL
