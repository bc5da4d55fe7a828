"""tenants.Limiter: Redis-enforced request, token and concurrency limits, leases,
and one limit shared across connections, against a real redis-server
(tests.fixtures_redis)."""
from __future__ import annotations

import threading

import pytest
import redis

from tenants import (Limiter, Quota, QuotaExceeded, RequestTooLarge, Tenant, TenantStore,
                     check_request_tokens)
from tests.tenant_helpers import make_tenant

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0  # an injected clock; limits only compare differences


def test_requests_per_minute_trips_and_recovers(redis_client: redis.Redis) -> None:
    limiter, t = Limiter(redis_client), make_tenant(requests_per_minute=3)
    for dt_ in (0, 10, 20):
        limiter.admit(t, f"r{dt_}", 1, now=T0 + dt_)
    with pytest.raises(QuotaExceeded) as info:
        limiter.admit(t, "r30", 1, now=T0 + 30)
    assert info.value.limit_name == "requests_per_minute"
    assert info.value.retry_after_seconds == 30  # the request at T0 leaves at T0 + 60
    assert "requests_per_minute" in str(info.value)
    limiter.admit(t, "r60", 1, now=T0 + 60)
    with pytest.raises(QuotaExceeded) as info:
        limiter.admit(t, "r60.5", 1, now=T0 + 60.5)
    assert info.value.retry_after_seconds == 10  # ceil(T0 + 10 + 60 - (T0 + 60.5))


def test_tokens_per_minute_trips_and_recovers(redis_client: redis.Redis) -> None:
    limiter, t = Limiter(redis_client), make_tenant(tokens_per_minute=100)
    limiter.admit(t, "a", 60, now=T0)
    limiter.admit(t, "b", 30, now=T0 + 10)
    with pytest.raises(QuotaExceeded) as info:
        limiter.admit(t, "c", 20, now=T0 + 20)
    assert info.value.limit_name == "tokens_per_minute"
    assert info.value.retry_after_seconds == 40  # "a"'s 60 tokens leave at T0 + 60
    with pytest.raises(QuotaExceeded) as info:
        limiter.admit(t, "c", 80, now=T0 + 20)
    assert info.value.retry_after_seconds == 50  # needs "b"'s tokens gone too
    assert limiter.current(t, now=T0 + 20)["tokens_in_window"] == 90
    limiter.admit(t, "c", 20, now=T0 + 60)
    assert limiter.current(t, now=T0 + 60)["tokens_in_window"] == 50


def test_release_corrects_the_token_charge(redis_client: redis.Redis) -> None:
    limiter, t = Limiter(redis_client), make_tenant(tokens_per_minute=100)
    a = limiter.admit(t, "a", 90, now=T0)
    with pytest.raises(QuotaExceeded):
        limiter.admit(t, "b", 20, now=T0 + 1)
    assert limiter.release(a, actual_tokens=25) is True
    assert limiter.current(t, now=T0 + 1)["tokens_in_window"] == 25
    assert limiter.release(a, actual_tokens=25) is False  # twice: no double correction
    assert limiter.current(t, now=T0 + 1)["tokens_in_window"] == 25
    limiter.admit(t, "b", 75, now=T0 + 2)


def test_estimate_above_tokens_per_minute_can_never_succeed(redis_client: redis.Redis) -> None:
    limiter = Limiter(redis_client)
    with pytest.raises(RequestTooLarge) as info:
        limiter.admit(make_tenant(tokens_per_minute=100), "big", 101, now=T0)
    assert info.value.limit_name == "tokens_per_minute"


def test_concurrency_trips_and_recovers_on_release(redis_client: redis.Redis) -> None:
    limiter, t = Limiter(redis_client), make_tenant(max_concurrent_requests=2)
    a = limiter.admit(t, "a", 0, now=T0)
    limiter.admit(t, "b", 0, now=T0)
    with pytest.raises(QuotaExceeded) as info:
        limiter.admit(t, "c", 0, now=T0 + 1)
    assert info.value.limit_name == "max_concurrent_requests"
    assert info.value.retry_after_seconds == 1
    limiter.release(a, 0)
    limiter.admit(t, "c", 0, now=T0 + 1)
    assert limiter.current(t, now=T0 + 1)["concurrent_requests"] == 2


def test_refusal_records_nothing(redis_client: redis.Redis) -> None:
    # rpm and tpm would pass; concurrency fails: no request or token is charged.
    limiter = Limiter(redis_client)
    t = make_tenant(requests_per_minute=10, tokens_per_minute=1000, max_concurrent_requests=1)
    limiter.admit(t, "a", 100, now=T0)
    for i in range(3):
        with pytest.raises(QuotaExceeded):
            limiter.admit(t, f"x{i}", 100, now=T0 + 1)
    assert limiter.current(t, now=T0 + 1) == {
        "window_seconds": 60.0, "requests_in_window": 1, "tokens_in_window": 100,
        "concurrent_requests": 1}


def test_the_longest_wait_is_reported(redis_client: redis.Redis) -> None:
    limiter = Limiter(redis_client)
    t = make_tenant(requests_per_minute=1, max_concurrent_requests=1)
    limiter.admit(t, "a", 0, now=T0)
    with pytest.raises(QuotaExceeded) as info:
        limiter.admit(t, "b", 0, now=T0 + 5)
    assert (info.value.limit_name, info.value.retry_after_seconds) == ("requests_per_minute", 55)


def test_zero_limit_refuses_everything(redis_client: redis.Redis) -> None:
    with pytest.raises(QuotaExceeded) as info:
        Limiter(redis_client).admit(make_tenant(requests_per_minute=0), "a", 0, now=T0)
    assert info.value.retry_after_seconds == 60


def test_expired_lease_is_reclaimed_and_renew_extends_it(redis_client: redis.Redis) -> None:
    limiter = Limiter(redis_client, lease_seconds=5)
    t = make_tenant(max_concurrent_requests=1)
    crashed = limiter.admit(t, "crashed", 0, now=T0)
    assert crashed.lease_expires_at == pytest.approx(T0 + 5)
    with pytest.raises(QuotaExceeded):
        limiter.admit(t, "b", 0, now=T0 + 4)
    live = limiter.admit(t, "b", 0, now=T0 + 5.5)  # the crashed process's slot expired
    assert limiter.renew([crashed, live], now=T0 + 5.5) == [crashed]
    assert limiter.release(crashed, 0) is False
    assert limiter.renew([live], now=T0 + 9) == []  # now held until T0 + 14
    with pytest.raises(QuotaExceeded):
        limiter.admit(t, "c", 0, now=T0 + 12)
    limiter.admit(t, "c", 0, now=T0 + 14.5)


def test_a_heartbeat_never_brings_back_a_released_lease(redis_client: redis.Redis) -> None:
    limiter = Limiter(redis_client, lease_seconds=5)
    t = make_tenant(max_concurrent_requests=1)
    done = limiter.admit(t, "done", 0, now=T0)
    assert limiter.release(done, 0) is True
    assert limiter.renew([done], now=T0 + 1) == [done]
    limiter.admit(t, "next", 0, now=T0 + 1)  # the slot stayed free


def test_leases_name_their_holder_and_only_the_silent_holder_loses_them(redis_client: redis.Redis) -> None:
    """Two replicas' limiters on one Redis: the one that keeps beating keeps its long request's
    lease past many lease times; the silent one's lease is reclaimed by the live one's admit."""
    live, dead = Limiter(redis_client, lease_seconds=3, holder="r1"), Limiter(redis_client, lease_seconds=3,
                                                                               holder="r2")
    assert live.holder.startswith("r1.") and live.holder != Limiter(redis_client, holder="r1").holder
    t = make_tenant(max_concurrent_requests=2)
    long_request = live.admit(t, "long", 0, now=T0)
    orphan = dead.admit(t, "orphan", 0, now=T0)
    assert long_request.slot_id.startswith(f"{live.holder}/long#")
    assert orphan.slot_id.startswith(f"{dead.holder}/orphan#")
    members = {m.decode() for m in redis_client.zrange(f"lp:t:{t.id}:rl:conc", 0, -1)}
    assert members == {long_request.slot_id, orphan.slot_id}
    with pytest.raises(QuotaExceeded):
        live.admit(t, "x", 0, now=T0 + 2)
    for beat in range(1, 11):  # ten beats a second apart: the long request's lease never lapses
        assert live.renew([long_request], now=T0 + beat) == []
    third = live.admit(t, "third", 0, now=T0 + 10)  # the orphan's slot, reclaimed
    with pytest.raises(QuotaExceeded):
        live.admit(t, "fourth", 0, now=T0 + 10)
    assert live.current(t, now=T0 + 10)["concurrent_requests"] == 2
    assert dead.release(orphan, 0) is False and live.release(long_request, 0) is True
    assert live.release(third, 0) is True


def test_default_clock_is_redis_time(redis_client: redis.Redis) -> None:
    limiter, t = Limiter(redis_client), make_tenant(requests_per_minute=1)
    server_now = float(redis_client.time()[0])
    a = limiter.admit(t, "a", 0)
    assert abs(a.admitted_at - server_now) < 5
    with pytest.raises(QuotaExceeded) as info:
        limiter.admit(t, "b", 0)
    assert 55 <= info.value.retry_after_seconds <= 60


def test_deleting_a_tenant_drops_its_limiter_state(redis_client: redis.Redis) -> None:
    store, limiter = TenantStore(redis_client), Limiter(redis_client)
    old = store.create("acme", Quota(requests_per_minute=1, max_concurrent_requests=1))
    held = limiter.admit(old, "a", 5, now=T0)
    assert held.tenant == old.id
    assert len(list(redis_client.scan_iter(f"lp:t:{old.id}:rl:*"))) == 4
    store.delete("acme")
    assert list(redis_client.scan_iter(f"lp:t:{old.id}:rl:*")) == []
    new = store.create("acme", Quota(requests_per_minute=1, max_concurrent_requests=1))
    assert limiter.current(new, now=T0 + 1)["concurrent_requests"] == 0
    fresh = limiter.admit(new, "a", 5, now=T0 + 1)
    # The old request finishing late touches nothing of the new tenant's.
    assert limiter.release(held, 5) is False
    assert limiter.current(new, now=T0 + 1) == {
        "window_seconds": 60.0, "requests_in_window": 1, "tokens_in_window": 5,
        "concurrent_requests": 1}
    assert limiter.release(fresh, 5) is True


def test_limiter_keys_are_per_id_not_per_name(redis_client: redis.Redis) -> None:
    limiter = Limiter(redis_client)
    first = make_tenant(max_concurrent_requests=1)
    limiter.admit(first, "a", 0, now=T0)
    other = Tenant(name="acme", id="0123456789abcdef", quota=first.quota)
    limiter.admit(other, "a", 0, now=T0)  # same name, another tenant: its own slots
    with pytest.raises(TypeError):
        limiter.current("acme")  # type: ignore[arg-type]


@pytest.mark.parametrize("limit_field", ["requests_per_minute", "max_concurrent_requests"])
def test_two_limiters_on_two_connections_share_one_limit(redis_url: str, limit_field: str) -> None:
    limit, threads_per_limiter, attempts = 23, 4, 12
    t = make_tenant(**{limit_field: limit})
    clients = [redis.Redis.from_url(redis_url) for _ in range(2)]
    limiters = [Limiter(c) for c in clients]
    admitted: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(2 * threads_per_limiter)

    def hammer(limiter: Limiter, worker: int) -> None:
        start.wait()
        for i in range(attempts):
            try:
                a = limiter.admit(t, f"w{worker}-{i}", 1, now=T0)
            except QuotaExceeded:
                continue
            with lock:
                admitted.append(a.slot_id)

    threads = [threading.Thread(target=hammer, args=(limiters[w % 2], w))
               for w in range(2 * threads_per_limiter)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for c in clients:
        c.close()
    assert len(admitted) == limit and len(set(admitted)) == limit


def test_check_request_tokens() -> None:
    check_request_tokens(make_tenant(max_tokens_per_request=64), 64)
    check_request_tokens(make_tenant(), 10**9)
    with pytest.raises(RequestTooLarge, match="max_tokens_per_request") as info:
        check_request_tokens(make_tenant(max_tokens_per_request=64), 65)
    assert isinstance(info.value, ValueError)


def test_limiter_rejects_bad_arguments(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError):
        Limiter(redis_client, window_seconds=0)
    with pytest.raises(ValueError):
        Limiter(redis_client).admit(make_tenant(), "a", -1)
