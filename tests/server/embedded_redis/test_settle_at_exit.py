"""Settlements at a replica's exit. The stop's lifespan closes the Redis client right after
`Settlements.stop()`; requests the stop cut settle from their own cleanup, in worker threads, at the
same time. Before, stop() returned while such a settle's pipeline was still reading, the client was
closed under it and `ValueError: I/O operation on closed file` (not a RedisError) came out as a
traceback on Ctrl-C. Now stop() waits (bounded) for them, and a settle after it touches no Redis.
Real redis-server; a proxy in its own process puts it 150 ms away so a settle is seen under way."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from server.api.auth import Settlements
from server.embedded_redis.server import free_port
from tenants import Limiter, TenantStore, UsageLog
from tests.repo import ROOT_DIR

pytestmark = pytest.mark.unit

DELAY_MS = 150


@pytest.fixture
def distant_redis(redis_url: str, redis_server) -> Iterator[redis.Redis]:
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "tests.latency_proxy", str(port), str(redis_server.port),
                              str(DELAY_MS)], cwd=ROOT_DIR, stdout=subprocess.PIPE, text=True)
    client = redis.Redis.from_url(redis_url.replace(f":{redis_server.port}", f":{port}"))
    try:
        assert proxy.stdout.readline().strip() == "ready"
        yield client
    finally:
        client.close()
        proxy.kill()
        proxy.wait(10)


def _world(client: redis.Redis):
    limiter, usage = Limiter(client), UsageLog(client)
    tenant = TenantStore(client).create("acme")
    return limiter, usage, tenant, Settlements(limiter, usage, settle_interval=60.0)


def _requests(usage: UsageLog, tenant) -> tuple[int, int]:
    total = usage.get(tenant)["total"]
    return total["requests"], total["completion_tokens"]


def test_stop_waits_for_a_settle_under_way(distant_redis: redis.Redis, redis_client: redis.Redis) -> None:
    limiter, usage, tenant, settlements = _world(distant_redis)
    admission = limiter.admit(tenant, "r1", 10)
    settlements.open(tenant, admission, 4)
    worker = threading.Thread(target=settlements.settle, args=(tenant, admission, 4, 6))
    worker.start()
    time.sleep(DELAY_MS / 1000 / 3)   # inside its first round trip (the release, then the usage record)
    settlements.stop()                # no grace: only what is under way
    # Read straight from Redis: the settle is done (two round trips through the proxy) before stop returns.
    assert _requests(UsageLog(redis_client), tenant) == (1, 6), "stop() returned while a settle used the client"
    assert Limiter(redis_client).current(tenant)["concurrent_requests"] == 0
    distant_redis.close()             # what the server does next: harmless now
    worker.join(10)
    assert not worker.is_alive()


def test_stop_gives_open_requests_their_grace_and_later_settles_touch_no_redis(
        distant_redis: redis.Redis, redis_client: redis.Redis) -> None:
    limiter, usage, tenant, settlements = _world(distant_redis)
    admissions = [limiter.admit(tenant, f"r{i}", 10) for i in range(3)]
    for a in admissions:
        settlements.open(tenant, a, 4)
    settlements.follow(admissions[2], lambda: 5)
    grace = 3.0
    stopped = threading.Event()
    started = time.monotonic()
    stopper = threading.Thread(target=lambda: (settlements.stop(grace=grace), stopped.set()))
    stopper.start()
    time.sleep(0.3)
    assert not stopped.is_set(), "stop() did not wait for the open requests"
    for a in admissions[:2]:   # cut by the server's stop: they settle from their cleanup
        threading.Thread(target=settlements.settle, args=(tenant, a, 4, 7)).start()
    # Both settled within the grace, the third still open: stop() waits on for it, then gives up.
    time.sleep(1.5)
    assert _requests(UsageLog(redis_client), tenant) == (2, 14)
    assert not stopped.is_set(), "stop() stopped waiting while a request was still open"
    assert stopped.wait(30)
    assert time.monotonic() - started >= grace
    # The last record had what the third reached: its request and 5 tokens.
    direct = UsageLog(redis_client)
    assert _requests(direct, tenant) == (3, 7 + 7 + 5)
    assert Limiter(redis_client).current(tenant)["concurrent_requests"] == 1   # its lease lapses by itself
    distant_redis.close()
    before = time.monotonic()
    settlements.settle(tenant, admissions[2], 4, 9)   # after stop(): nothing recorded, no round trip
    assert time.monotonic() - before < DELAY_MS / 1000
    assert _requests(direct, tenant) == (3, 19)
