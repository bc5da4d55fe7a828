"""tenants/: quotas, tenant CRUD, API keys and usage, against a real redis-server
(tests.fixtures_redis). The Limiter's tests are in test_tenant_limits.py."""
from __future__ import annotations

import datetime as dt

import pytest
import redis

from tenants import (Quota, QuotaError, RunUsage, Tenant, TenantExists, TenantIdError, TenantNameError,
                     TenantNotFound, TenantStore, UsageLog)
from tenants.limits import ENDED_RUN_TTL_SECONDS
from tests.tenant_helpers import ACME_ID

pytestmark = pytest.mark.unit


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
    assert Tenant(name=name, id=ACME_ID).name == name


@pytest.mark.parametrize("name", ["", "Acme", "-lead", "_x", "a" * 64, "a:b", "a b", "é", 7, None])
def test_invalid_tenant_names(name: object) -> None:
    with pytest.raises(TenantNameError):
        Tenant(name=name, id=ACME_ID)  # type: ignore[arg-type]


@pytest.mark.parametrize("tenant_id", ["", "acme", "0" * 15, "0" * 17, "0123456789ABCDEF",
                                       "0123456789abcdeg", None, 7])
def test_invalid_tenant_ids(tenant_id: object) -> None:
    with pytest.raises(TenantIdError):
        Tenant(name="acme", id=tenant_id)  # type: ignore[arg-type]


def test_tenant_dict_has_its_id() -> None:
    t = Tenant(name="acme", id=ACME_ID, quota=Quota(max_adapters=2), created_at=5.0)
    assert t.to_dict() == {"id": ACME_ID, "name": "acme", "quota": Quota(max_adapters=2).to_dict(),
                           "created_at": 5.0}


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
    assert len(created.id) == 16
    assert store.get("acme") == created
    assert store.get("nobody") is None
    assert store.create("beta").id != created.id
    assert [t.name for t in store.list()] == ["acme", "beta"]

    with pytest.raises(TenantExists):
        store.create("acme", Quota())
    with pytest.raises(TenantNameError):
        store.create("Bad Name")

    updated = store.update_quota("acme", {"tokens_per_minute": 900, "requests_per_minute": None})
    assert updated.quota == Quota(tokens_per_minute=900, weight=3.0)
    assert updated.created_at == created.created_at and updated.id == created.id
    assert store.get("acme") == updated

    assert store.delete("acme") == updated
    assert store.delete("acme") is None
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
    assert again.created_at == first.created_at and again.id == first.id
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
    assert tenant == store.get("acme")

    listed = store.list_keys("acme")
    assert [k["id"] for k in listed] == [key_id] and set(listed[0]) == {"id", "created_at", "last_used_at"}
    assert listed[0]["last_used_at"] >= listed[0]["created_at"]  # authenticated just above
    second_id, _ = store.create_key("acme")
    assert [k["last_used_at"] for k in store.list_keys("acme") if k["id"] == second_id] == [None]
    assert store.revoke_key("acme", second_id) is True

    assert store.revoke_key("beta", key_id) is False  # not that tenant's key
    assert store.authenticate(key) is not None
    assert store.revoke_key("acme", key_id) is True
    assert store.authenticate(key) is None
    assert store.revoke_key("acme", key_id) is False
    assert store.list_keys("acme") == []
    assert store._r.exists(f"lp:apikey:{key_id}") == 0  # a late last-use write never resurrects it


def test_each_key_is_independent(store: TenantStore) -> None:
    store.create("acme")
    store.create("beta")
    (id1, k1), (_, k2) = store.create_key("acme"), store.create_key("acme")
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


# ---- usage ----

def test_usage_record_and_get_are_exact(redis_client: redis.Redis) -> None:
    store, usage = TenantStore(redis_client), UsageLog(redis_client)
    acme, beta = store.create("acme"), store.create("beta")
    day1 = dt.datetime(2026, 3, 1, 23, 59, tzinfo=dt.timezone.utc).timestamp()
    day2 = day1 + 120  # past UTC midnight
    assert usage.record(acme, prompt_tokens=10, completion_tokens=5, now=day1) is True
    usage.record(acme, prompt_tokens=7, completion_tokens=3, now=day1, adapter="sql")
    usage.record(acme, prompt_tokens=1, completion_tokens=2, requests=4, now=day2, adapter="sql")
    usage.record(beta, prompt_tokens=100, completion_tokens=100, now=day2)

    got = usage.get(acme, days=3, now=day2)
    base = {"requests": 1, "prompt_tokens": 10, "completion_tokens": 5}
    assert got["days"] == [
        {"date": "2026-02-28", "requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "adapters": {}},
        {"date": "2026-03-01", "requests": 2, "prompt_tokens": 17, "completion_tokens": 8,
         "adapters": {"": base, "sql": {"requests": 1, "prompt_tokens": 7, "completion_tokens": 3}}},
        {"date": "2026-03-02", "requests": 4, "prompt_tokens": 1, "completion_tokens": 2,
         "adapters": {"sql": {"requests": 4, "prompt_tokens": 1, "completion_tokens": 2}}},
    ]
    assert got["total"] == {"requests": 6, "prompt_tokens": 18, "completion_tokens": 10,
                            "adapters": {"": base, "sql": {"requests": 5, "prompt_tokens": 8, "completion_tokens": 5}}}
    with pytest.raises(ValueError):
        usage.record(acme, 1, 1, adapter="a:b")
    assert usage.get(acme, now=day2)["total"]["requests"] == 4
    assert usage.get(beta, now=day2)["total"]["requests"] == 1


def test_usage_is_not_recorded_for_a_tenant_that_is_gone(redis_client: redis.Redis) -> None:
    # A request that finishes after its tenant was deleted must leave nothing behind.
    store, usage = TenantStore(redis_client), UsageLog(redis_client)
    acme = store.create("acme")
    store.delete("acme")
    assert usage.record(acme, 1, 1) is False
    assert usage.record(Tenant(name="ghost", id=ACME_ID), 1, 1) is False
    assert list(redis_client.scan_iter("lp:t:*")) == []


def test_running_requests_usage_so_far_is_added_once_however_often_it_is_sent(redis_client: redis.Redis) -> None:
    # The usage thread sends every running request's totals so far in one round trip; a round whose
    # reply was lost is sent again, and the request's final record after it: each counts once.
    store, usage = TenantStore(redis_client), UsageLog(redis_client)
    acme, beta, gone = store.create("acme"), store.create("beta"), store.create("gone")
    store.delete("gone")
    now = dt.datetime(2026, 3, 1, 12, tzinfo=dt.timezone.utc).timestamp()
    first = [RunUsage(acme, "r1", 10, 5), RunUsage(acme, "r2", 7, 3, adapter="sql"), RunUsage(gone, "r3", 1, 1),
             RunUsage(beta, "r4", 2, 9)]
    assert usage.record_so_far(first, now=now) == [True, True, False, True]
    assert usage.record_so_far(first, now=now) == [True, True, False, True]  # sent again: nothing added
    assert usage.record_so_far([RunUsage(acme, "r1", 10, 8)], now=now) == [True]  # 3 more tokens
    assert usage.record_so_far([RunUsage(acme, "r1", 10, 9)], final=True, now=now) == [True]
    assert usage.record_so_far([RunUsage(acme, "r1", 10, 9)], final=True, now=now) == [True]  # a retried final
    assert usage.record_so_far([]) == []
    assert usage.get(acme, now=now)["total"] == {
        "requests": 2, "prompt_tokens": 17, "completion_tokens": 12,
        "adapters": {"": {"requests": 1, "prompt_tokens": 10, "completion_tokens": 9},
                     "sql": {"requests": 1, "prompt_tokens": 7, "completion_tokens": 3}}}
    assert usage.get(beta, now=now)["total"]["completion_tokens"] == 9
    assert list(redis_client.scan_iter(f"lp:t:{gone.id}:*")) == []
    ended = redis_client.ttl(f"lp:t:{acme.id}:running:r1")
    assert 0 < ended <= ENDED_RUN_TTL_SECONDS < redis_client.ttl(f"lp:t:{acme.id}:running:r2")
    with pytest.raises(ValueError):  # checked before anything is sent
        usage.record_so_far([RunUsage(beta, "r5", 1, 1), RunUsage(beta, "r6", -1, 1)])
    assert usage.get(beta, now=now)["total"]["completion_tokens"] == 9


def test_usage_keys_expire_and_are_indexed(redis_client: redis.Redis) -> None:
    acme = TenantStore(redis_client).create("acme")
    UsageLog(redis_client, retention_days=90).record(acme, 1, 1)
    (key,) = list(redis_client.scan_iter(f"lp:t:{acme.id}:usage:*"))
    assert 90 * 86400 < redis_client.ttl(key) <= 91 * 86400
    index = f"lp:t:{acme.id}:usage"
    assert redis_client.zrange(index, 0, -1) == [key]
    assert 90 * 86400 < redis_client.ttl(index) <= 91 * 86400


def test_usage_rejects_bad_arguments(redis_client: redis.Redis) -> None:
    usage = UsageLog(redis_client, retention_days=90)
    acme = TenantStore(redis_client).create("acme")
    with pytest.raises(ValueError):
        usage.record(acme, -1, 0)
    with pytest.raises(ValueError):
        usage.get(acme, days=0)
    with pytest.raises(ValueError):
        usage.get(acme, days=91)
    with pytest.raises(TypeError):  # a bare name could be another tenant's history
        usage.get("acme")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        usage.record("acme", 1, 1)  # type: ignore[arg-type]
    assert len(usage.get(acme, days=90)["days"]) == 90
