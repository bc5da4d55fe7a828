"""tenants/: quotas, tenant CRUD, API keys, usage and Redis-enforced limits,
against a real redis-server (tests.fixtures_redis)."""
from __future__ import annotations

import datetime as dt
import threading

import pytest
import redis

from tenants import (Limiter, Quota, QuotaError, QuotaExceeded, RequestTooLarge, Tenant,
                     TenantExists, TenantNameError, TenantNotFound, TenantStore, UsageLog,
                     check_request_tokens)

T0 = 1_700_000_000.0  # an injected clock; limits only compare differences


# ---- Quota and Tenant values ---------------------------------------------

def test_quota_defaults_are_unlimited_with_weight_one() -> None:
    q = Quota.from_dict({})
    assert q == Quota()
    assert all(v is None for k, v in q.to_dict().items() if k != "weight")
    assert q.weight == 1.0


def test_quota_round_trips_through_dict() -> None:
    d = {"requests_per_minute": 10, "tokens_per_minute": 1000, "max_concurrent_requests": 2,
         "max_adapters": 5, "max_adapter_bytes": 1 << 20, "max_lora_rank": 16,
         "max_tokens_per_request": 256, "weight": 2.5}
    assert Quota.from_dict(d).to_dict() == d


@pytest.mark.parametrize("patch, field", [
    ({"requests_per_hour": 1}, "requests_per_hour"),
    ({"requests_per_minute": "10"}, "requests_per_minute"),
    ({"tokens_per_minute": -1}, "tokens_per_minute"),
    ({"max_lora_rank": 8.0}, "max_lora_rank"),
    ({"max_adapters": True}, "max_adapters"),
    ({"weight": 0}, "weight"),
    ({"weight": -1.0}, "weight"),
    ({"weight": float("nan")}, "weight"),
    ({"weight": None}, "weight"),
    ({"weight": "heavy"}, "weight"),
])
def test_bad_quota_fields_are_named(patch: dict, field: str) -> None:
    with pytest.raises(QuotaError, match=field) as info:
        Quota.from_dict(patch)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_quota_from_non_object_is_refused() -> None:
    with pytest.raises(QuotaError):
        Quota.from_dict([1, 2])


def test_quota_merge_replaces_only_named_fields_and_null_means_unlimited() -> None:
    q = Quota(requests_per_minute=10, tokens_per_minute=100, weight=2)
    m = q.merge({"requests_per_minute": None, "max_lora_rank": 8})
    assert m == Quota(tokens_per_minute=100, max_lora_rank=8, weight=2.0)
    assert q.requests_per_minute == 10  # the original is untouched


@pytest.mark.parametrize("name", ["a", "acme", "team-1", "x_y", "0abc", "a" * 63])
def test_valid_tenant_names(name: str) -> None:
    assert Tenant(name=name).name == name


@pytest.mark.parametrize("name", ["", "Acme", "-lead", "_x", "a" * 64, "a:b", "a b", "é", 7, None])
def test_invalid_tenant_names(name: object) -> None:
    with pytest.raises(TenantNameError):
        Tenant(name=name)  # type: ignore[arg-type]


# ---- TenantStore ---------------------------------------------------------

@pytest.fixture(params=[False, True], ids=["bytes", "decoded"])
def store(request: pytest.FixtureRequest, redis_url: str) -> TenantStore:
    # Callers may hand us either kind of client.
    client = redis.Redis.from_url(redis_url, decode_responses=request.param)
    request.addfinalizer(client.close)
    return TenantStore(client)


def test_tenant_crud(store: TenantStore) -> None:
    q = Quota(requests_per_minute=5, weight=3.0)
    created = store.create("acme", q)
    assert created.name == "acme" and created.quota == q and created.created_at > 0
    assert store.get("acme") == created
    assert store.get("nobody") is None
    store.create("beta")
    assert [t.name for t in store.list()] == ["acme", "beta"]

    with pytest.raises(TenantExists):
        store.create("acme", Quota())
    with pytest.raises(TenantNameError):
        store.create("Bad Name")

    updated = store.update_quota("acme", {"tokens_per_minute": 900, "requests_per_minute": None})
    assert updated.quota == Quota(tokens_per_minute=900, weight=3.0)
    assert updated.created_at == created.created_at
    assert store.get("acme") == updated

    assert store.delete("acme") is True
    assert store.delete("acme") is False
    assert store.get("acme") is None
    assert [t.name for t in store.list()] == ["beta"]


def test_update_quota_errors_write_nothing(store: TenantStore) -> None:
    store.create("acme", Quota(requests_per_minute=5))
    with pytest.raises(QuotaError, match="bogus"):
        store.update_quota("acme", {"requests_per_minute": 1, "bogus": 2})
    assert store.get("acme").quota == Quota(requests_per_minute=5)
    with pytest.raises(TenantNotFound):
        store.update_quota("ghost", {"requests_per_minute": 1})


def test_ensure_is_idempotent_and_keeps_an_existing_quota(store: TenantStore) -> None:
    first = store.ensure("default", Quota(weight=1.0))
    store.update_quota("default", {"max_adapters": 3})
    again = store.ensure("default", Quota(weight=9.0))
    assert again.quota.max_adapters == 3 and again.quota.weight == 1.0
    assert again.created_at == first.created_at
    assert len(store.list()) == 1


def test_prefixes_isolate_stores(redis_client: redis.Redis) -> None:
    a, b = TenantStore(redis_client, prefix="a:"), TenantStore(redis_client, prefix="b:")
    a.create("acme")
    assert b.get("acme") is None and b.list() == []
    assert all(k.startswith(b"a:") for k in redis_client.keys("*"))


# ---- API keys ------------------------------------------------------------

def test_key_create_authenticate_revoke(store: TenantStore) -> None:
    store.create("acme", Quota(requests_per_minute=7))
    key_id, key = store.create_key("acme")
    assert key.startswith(f"lp-{key_id}.")
    tenant = store.authenticate(key)
    assert tenant is not None and tenant.name == "acme" and tenant.quota.requests_per_minute == 7

    listed = store.list_keys("acme")
    assert [k["id"] for k in listed] == [key_id] and set(listed[0]) == {"id", "created_at"}

    assert store.revoke_key("beta", key_id) is False  # not that tenant's key
    assert store.authenticate(key) is not None
    assert store.revoke_key("acme", key_id) is True
    assert store.authenticate(key) is None
    assert store.revoke_key("acme", key_id) is False
    assert store.list_keys("acme") == []


def test_each_key_is_independent(store: TenantStore) -> None:
    store.create("acme")
    store.create("beta")
    (id1, k1), (id2, k2) = store.create_key("acme"), store.create_key("acme")
    _, k3 = store.create_key("beta")
    assert len({k1, k2, k3}) == 3
    store.revoke_key("acme", id1)
    assert store.authenticate(k1) is None
    assert store.authenticate(k2).name == "acme"
    assert store.authenticate(k3).name == "beta"


def test_wrong_secret_is_refused(store: TenantStore) -> None:
    store.create("acme")
    key_id, key = store.create_key("acme")
    secret = key.split(".", 1)[1]
    flipped = ("B" if secret[0] == "A" else "A") + secret[1:]
    assert store.authenticate(f"lp-{key_id}.{flipped}") is None
    assert store.authenticate(key[:-1]) is None
    assert store.authenticate(key + "x") is None


@pytest.mark.parametrize("garbage", [
    None, 123, b"lp-0123456789abcdef.x", "", "lp-", "lp-.", "Bearer lp-abc", "lp-zzzz.yyyy",
    "lp-0123456789abcdef." + "A" * 43, "lp-0123456789abcdef" + "." * 44, "x" * 100_000,
    "lp-0123456789abcdef.\u00e9" + "A" * 42, "lp-0123456789abcdef.AAAA\x00",
])
def test_garbage_keys_authenticate_nobody(store: TenantStore, garbage: object) -> None:
    store.create("acme")
    store.create_key("acme")
    assert store.authenticate(garbage) is None


def test_key_of_deleted_tenant_is_dead_even_after_the_name_is_reused(store: TenantStore) -> None:
    store.create("acme")
    key_id, key = store.create_key("acme")
    store.delete("acme")
    assert store.authenticate(key) is None
    store.create("acme")
    assert store.authenticate(key) is None
    assert store.list_keys("acme") == []


def test_create_key_for_missing_tenant(store: TenantStore) -> None:
    with pytest.raises(TenantNotFound):
        store.create_key("ghost")


def _dump_keyspace(client: redis.Redis) -> bytes:
    """Every key name and value in the database, concatenated."""
    out = []
    for key in client.scan_iter("*"):
        out.append(key)
        kind = client.type(key)
        if kind == b"string":
            out.append(client.get(key))
        elif kind == b"hash":
            for f, v in client.hgetall(key).items():
                out += [f, v]
        elif kind == b"set":
            out += list(client.smembers(key))
        elif kind == b"zset":
            out += list(client.zrange(key, 0, -1))
        else:
            raise AssertionError(f"unexpected type {kind!r} for {key!r}")
    return b"\n".join(out)


def test_keys_are_not_stored_in_plaintext(redis_client: redis.Redis) -> None:
    store = TenantStore(redis_client)
    store.create("acme")
    key_id, key = store.create_key("acme")
    secret = key.split(".", 1)[1]
    dump = _dump_keyspace(redis_client)
    assert key_id.encode() in dump  # the dump does see the key's record...
    assert secret.encode() not in dump and key.encode() not in dump  # ...but not the secret


# ---- limits --------------------------------------------------------------

def _tenant(**quota: object) -> Tenant:
    return Tenant(name="acme", quota=Quota(**quota))


def test_requests_per_minute_trips_and_recovers(redis_client: redis.Redis) -> None:
    limiter, t = Limiter(redis_client), _tenant(requests_per_minute=3)
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
    limiter, t = Limiter(redis_client), _tenant(tokens_per_minute=100)
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
    limiter, t = Limiter(redis_client), _tenant(tokens_per_minute=100)
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
        limiter.admit(_tenant(tokens_per_minute=100), "big", 101, now=T0)
    assert info.value.limit_name == "tokens_per_minute"


def test_concurrency_trips_and_recovers_on_release(redis_client: redis.Redis) -> None:
    limiter, t = Limiter(redis_client), _tenant(max_concurrent_requests=2)
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
    t = _tenant(requests_per_minute=10, tokens_per_minute=1000, max_concurrent_requests=1)
    limiter.admit(t, "a", 100, now=T0)
    for i in range(3):
        with pytest.raises(QuotaExceeded):
            limiter.admit(t, f"x{i}", 100, now=T0 + 1)
    assert limiter.current(t, now=T0 + 1) == {
        "window_seconds": 60.0, "requests_in_window": 1, "tokens_in_window": 100,
        "concurrent_requests": 1}


def test_the_longest_wait_is_reported(redis_client: redis.Redis) -> None:
    limiter = Limiter(redis_client)
    t = _tenant(requests_per_minute=1, max_concurrent_requests=1)
    limiter.admit(t, "a", 0, now=T0)
    with pytest.raises(QuotaExceeded) as info:
        limiter.admit(t, "b", 0, now=T0 + 5)
    assert (info.value.limit_name, info.value.retry_after_seconds) == ("requests_per_minute", 55)


def test_zero_limit_refuses_everything(redis_client: redis.Redis) -> None:
    with pytest.raises(QuotaExceeded) as info:
        Limiter(redis_client).admit(_tenant(requests_per_minute=0), "a", 0, now=T0)
    assert info.value.retry_after_seconds == 60


def test_expired_lease_is_reclaimed_and_renew_extends_it(redis_client: redis.Redis) -> None:
    limiter = Limiter(redis_client, lease_seconds=5)
    t = _tenant(max_concurrent_requests=1)
    crashed = limiter.admit(t, "crashed", 0, now=T0)
    assert crashed.lease_expires_at == pytest.approx(T0 + 5)
    with pytest.raises(QuotaExceeded):
        limiter.admit(t, "b", 0, now=T0 + 4)
    live = limiter.admit(t, "b", 0, now=T0 + 5.5)  # the crashed process's slot expired
    assert limiter.renew(crashed, now=T0 + 5.5) is False
    assert limiter.release(crashed, 0) is False
    assert limiter.renew(live, now=T0 + 9) is True  # now held until T0 + 14
    with pytest.raises(QuotaExceeded):
        limiter.admit(t, "c", 0, now=T0 + 12)
    limiter.admit(t, "c", 0, now=T0 + 14.5)


def test_default_clock_is_redis_time(redis_client: redis.Redis) -> None:
    limiter, t = Limiter(redis_client), _tenant(requests_per_minute=1)
    server_now = float(redis_client.time()[0])
    a = limiter.admit(t, "a", 0)
    assert abs(a.admitted_at - server_now) < 5
    with pytest.raises(QuotaExceeded) as info:
        limiter.admit(t, "b", 0)
    assert 55 <= info.value.retry_after_seconds <= 60


def test_deleting_a_tenant_drops_its_limiter_state(redis_client: redis.Redis) -> None:
    store, limiter = TenantStore(redis_client), Limiter(redis_client)
    t = store.create("acme", Quota(requests_per_minute=1))
    limiter.admit(t, "a", 5, now=T0)
    store.delete("acme")
    t = store.create("acme", Quota(requests_per_minute=1))
    limiter.admit(t, "a", 5, now=T0 + 1)


@pytest.mark.parametrize("limit_field", ["requests_per_minute", "max_concurrent_requests"])
def test_two_limiters_on_two_connections_share_one_limit(redis_url: str, limit_field: str) -> None:
    limit, threads_per_limiter, attempts = 23, 4, 12
    t = Tenant(name="acme", quota=Quota(**{limit_field: limit}))
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
    check_request_tokens(_tenant(max_tokens_per_request=64), 64)
    check_request_tokens(_tenant(), 10**9)
    with pytest.raises(RequestTooLarge, match="max_tokens_per_request") as info:
        check_request_tokens(_tenant(max_tokens_per_request=64), 65)
    assert isinstance(info.value, ValueError)


def test_limiter_rejects_bad_arguments(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError):
        Limiter(redis_client, window_seconds=0)
    with pytest.raises(ValueError):
        Limiter(redis_client).admit(_tenant(), "a", -1)


# ---- usage ---------------------------------------------------------------

def test_usage_record_and_get_are_exact(redis_client: redis.Redis) -> None:
    usage = UsageLog(redis_client)
    day1 = dt.datetime(2026, 3, 1, 23, 59, tzinfo=dt.timezone.utc).timestamp()
    day2 = day1 + 120  # past UTC midnight
    usage.record("acme", prompt_tokens=10, completion_tokens=5, now=day1)
    usage.record(_tenant(), prompt_tokens=7, completion_tokens=3, now=day1)
    usage.record("acme", prompt_tokens=1, completion_tokens=2, requests=4, now=day2)
    usage.record("beta", prompt_tokens=100, completion_tokens=100, now=day2)

    got = usage.get("acme", days=3, now=day2)
    assert got["days"] == [
        {"date": "2026-02-28", "requests": 0, "prompt_tokens": 0, "completion_tokens": 0},
        {"date": "2026-03-01", "requests": 2, "prompt_tokens": 17, "completion_tokens": 8},
        {"date": "2026-03-02", "requests": 4, "prompt_tokens": 1, "completion_tokens": 2},
    ]
    assert got["total"] == {"requests": 6, "prompt_tokens": 18, "completion_tokens": 10}
    assert usage.get("acme", now=day2)["total"]["requests"] == 4
    assert usage.get("ghost", days=2, now=day2)["total"] == {
        "requests": 0, "prompt_tokens": 0, "completion_tokens": 0}


def test_usage_keys_expire(redis_client: redis.Redis) -> None:
    UsageLog(redis_client, retention_days=90).record("acme", 1, 1)
    (key,) = list(redis_client.scan_iter("lp:usage:*"))
    ttl = redis_client.ttl(key)
    assert 90 * 86400 < ttl <= 91 * 86400


def test_usage_rejects_bad_arguments(redis_client: redis.Redis) -> None:
    usage = UsageLog(redis_client, retention_days=90)
    with pytest.raises(ValueError):
        usage.record("acme", -1, 0)
    with pytest.raises(ValueError):
        usage.get("acme", days=0)
    with pytest.raises(ValueError):
        usage.get("acme", days=91)
    assert len(usage.get("acme", days=90)["days"]) == 90
