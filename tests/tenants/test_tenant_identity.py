"""A tenant's identity is its immutable id: everything it owns is keyed by the id,
deleting it removes all of it, and a later tenant of the same name starts empty.
TenantStore, UsageLog, Limiter and AdapterRegistry together, the pending-purge
set, and the migration of data that earlier versions keyed by tenant name,
against a real redis-server (tests.fixtures_redis)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import redis

from adapters.registry import AdapterNotFound, AdapterRegistry, TenantAdaptersPurged
from tenants import Limiter, Quota, TenantIdError, TenantStore, UsageLog

pytestmark = pytest.mark.unit

GRACE = 60.0
DAY = 1_772_409_600.0  # 2026-03-02 00:00 UTC


@dataclass(frozen=True)
class Summary:
    rank: int = 8
    target_modules: tuple[str, ...] = ("q_proj",)
    size_bytes: int = 10


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def keys(r: redis.Redis, pattern: str = "*") -> set[str]:
    return {k.decode() for k in r.scan_iter(pattern)}


def put(reg: AdapterRegistry, tenant_id: str, name: str, seed: int = 1):
    return reg.put(tenant_id, name, b"{}", bytes([seed]) * 100, summary=Summary())


def events(pubsub, n: int) -> list[dict]:
    got, deadline = [], time.monotonic() + 5
    while len(got) < n and time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=0.2)
        if msg and msg["type"] == "message":
            got.append(json.loads(msg["data"]))
    return got


@pytest.fixture
def w(redis_client: redis.Redis) -> SimpleNamespace:
    clock = Clock()
    return SimpleNamespace(
        r=redis_client, clock=clock, store=TenantStore(redis_client), usage=UsageLog(redis_client),
        limiter=Limiter(redis_client),
        reg=AdapterRegistry(redis_client, chunk_size=64, grace_seconds=GRACE, clock=clock))


def populate(w: SimpleNamespace, name: str, quota: Quota = Quota()):
    """A tenant with a key, an adapter, usage on two days and a held lease."""
    tenant = w.store.create(name, quota)
    _, key = w.store.create_key(name)
    record = put(w.reg, tenant.id, "sql")
    w.usage.record(tenant, 3, 4, now=DAY - 60)
    w.usage.record(tenant, 5, 6, now=DAY)
    admission = w.limiter.admit(tenant, "r1", 9)
    return tenant, key, record, admission


# ---- delete, recreate, purge ----------------------------------------------

def _counters(total: dict) -> dict:
    return {k: v for k, v in total.items() if k != "adapters"}


def test_a_recreated_name_starts_empty(w: SimpleNamespace) -> None:
    quota = Quota(max_concurrent_requests=1)
    old, old_key, record, _ = populate(w, "acme", quota)
    assert w.store.delete("acme") == old
    w.reg.delete_all(old.id)
    w.store.purged(old.id)

    new = w.store.create("acme", quota)
    assert new.id != old.id
    assert w.reg.list(new.id) == [] and w.reg.count(new.id) == 0
    assert w.reg.get(new.id, "sql") is None
    assert w.reg.get_version(record.version, tenant_id=new.id) is None
    assert w.reg.get_version(record.version) == record  # running requests keep it for the grace
    assert _counters(w.usage.get(new, days=2, now=DAY)["total"]) == {
        "requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    assert w.limiter.current(new)["concurrent_requests"] == 0
    w.limiter.admit(new, "r2", 1)  # the old tenant's lease does not count
    assert w.store.authenticate(old_key) is None
    assert w.store.list_keys("acme") == []


def test_delete_removes_everything_the_tenant_owns(w: SimpleNamespace) -> None:
    populate(w, "beta")
    tenant_keys_before = keys(w.r, "lp:t:*") | keys(w.r, "lp:apikey:*")
    registry_before = keys(w.r, "lp:ad:*")
    acme, *_ = populate(w, "acme")
    assert keys(w.r, f"lp:t:{acme.id}:usage:*") and keys(w.r, f"lp:t:{acme.id}:rl:*")

    w.store.delete("acme")
    assert keys(w.r, "lp:t:*") | keys(w.r, "lp:apikey:*") == tenant_keys_before
    assert w.r.smembers("lp:tenants") == {b"beta"}
    # Adapters are another package's: they wait, listed in the purge set.
    assert w.store.pending_purges() == [acme.id]
    w.reg.delete_all(acme.id)
    w.clock.now += GRACE
    w.reg.collect_garbage()
    assert keys(w.r, "lp:ad:*") == registry_before | {f"lp:ad:gone:{acme.id}"}


def test_pending_purge_set_lifecycle(w: SimpleNamespace, redis_url: str) -> None:
    a, b = w.store.create("acme"), w.store.create("beta")
    assert w.store.pending_purges() == []
    assert w.store.delete("ghost") is None
    w.store.delete("acme")
    w.store.delete("beta")
    assert w.store.delete("acme") is None
    # The set is in Redis, so a process that died after delete() still finds it.
    restarted = redis.Redis.from_url(redis_url, decode_responses=True)
    assert TenantStore(restarted).pending_purges() == sorted([a.id, b.id])
    restarted.close()
    w.store.purged(a.id)
    w.store.purged(a.id)
    assert w.store.pending_purges() == [b.id]
    with pytest.raises(TenantIdError):
        w.store.purged("acme")


def test_delete_all_retires_publishes_and_is_collected_after_grace(w: SimpleNamespace) -> None:
    mine, other = "00000000000000a1", "00000000000000b2"
    alpha, sql = put(w.reg, mine, "alpha", 1), put(w.reg, mine, "sql", 2)
    kept = put(w.reg, other, "sql", 3)
    pubsub = w.r.pubsub()
    pubsub.subscribe(w.reg.events_channel)
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"

    assert w.reg.delete_all(mine) == [alpha, sql]
    got = sorted(events(pubsub, 2), key=lambda e: e["name"])
    assert got == [{"event": "deleted", "tenant": mine, "name": "alpha", "version": alpha.version},
                   {"event": "deleted", "tenant": mine, "name": "sql", "version": sql.version}]
    assert w.reg.delete_all(mine) == []  # idempotent: nothing more retired or published
    assert pubsub.get_message(timeout=0.3) is None
    pubsub.close()

    assert w.reg.list(mine) == [] and w.reg.count(mine) == 0
    w.clock.now += GRACE - 1
    assert w.reg.read_files(sql.version) == (b"{}", bytes([2]) * 100)
    w.clock.now += 1
    assert w.reg.collect_garbage() == 2
    with pytest.raises(AdapterNotFound):
        w.reg.read_files(alpha.version)
    assert w.reg.read_files(kept.version) == (b"{}", bytes([3]) * 100)
    referenced = set()
    for field in ("config_chunks", "weights_chunks"):
        referenced |= set(json.loads(w.r.hget(f"lp:ad:ver:{kept.version}", field)))
    assert keys(w.r, "lp:ad:chunk:*") == {f"lp:ad:chunk:{d}" for d in referenced}


class PurgedDuringUpload(AdapterRegistry):
    """The tenant is deleted (and purged) while its upload is being staged."""

    def _run_commit(self, record, *args, **kwargs):
        self.delete_all(record.tenant)
        return super()._run_commit(record, *args, **kwargs)


def test_an_upload_in_flight_cannot_recreate_a_purged_tenant(w: SimpleNamespace) -> None:
    tid = "00000000000000c3"
    racing = PurgedDuringUpload(w.r, chunk_size=64, grace_seconds=GRACE, clock=w.clock)
    with pytest.raises(TenantAdaptersPurged):
        racing.put(tid, "sql", b"{}", b"w" * 200, summary=Summary())
    with pytest.raises(AdapterNotFound):  # and so does any later put for that id
        put(w.reg, tid, "late")
    assert w.reg.list(tid) == [] and keys(w.r, "lp:ad:*") == {f"lp:ad:gone:{tid}"}
    assert put(w.reg, "00000000000000d4", "sql").name == "sql"  # others are unaffected


def test_name_and_id_keys_never_collide(w: SimpleNamespace) -> None:
    # A name may be spelled like an id; the `t:` segment keeps their keys apart.
    first = w.store.create("first")
    twin = w.store.create(first.id)
    w.usage.record(first, 1, 1, now=DAY)
    w.usage.record(twin, 2, 2, requests=2, now=DAY)
    put(w.reg, first.id, "mine")
    w.r.hset(f"lp:ad:idx:{twin.name}", "legacy", "0" * 32)  # a legacy index of the twin's name
    assert w.store.migrate_legacy_keys() == 0
    assert w.usage.get(first, now=DAY)["total"]["requests"] == 1
    assert w.usage.get(twin, now=DAY)["total"]["requests"] == 2
    assert [r.name for r in w.reg.list(first.id)] == ["mine"]
    assert w.reg.legacy_index_names() == [twin.name]


# ---- migration of name-keyed data ----------------------------------------

def write_legacy(r: redis.Redis, name: str, key_id: str, day: str, requests: int) -> None:
    """What versions before tenant ids wrote for a tenant called `name`."""
    r.sadd(f"lp:tenant:{name}:keys", key_id)
    r.hset(f"lp:usage:{name}:{day}", mapping={"requests": requests, "prompt_tokens": 10,
                                              "completion_tokens": 20})
    r.expire(f"lp:usage:{name}:{day}", 91 * 86400)
    now = float(r.time()[0])
    r.zadd(f"lp:rl:{name}:win", {"s1": now})
    r.hset(f"lp:rl:{name}:tok", "s1", 7)
    r.set(f"lp:rl:{name}:toksum", 7)
    r.zadd(f"lp:rl:{name}:conc", {"s1": now + 100})
    for part in ("win", "tok", "toksum", "conc"):
        r.expire(f"lp:rl:{name}:{part}", 180)


def test_migration_moves_name_keyed_data_to_the_id(w: SimpleNamespace) -> None:
    acme = w.store.create("acme")
    key_id, key = w.store.create_key("acme")
    w.r.rename(f"lp:t:{acme.id}:keys", "lp:tenant:acme:keys")  # the old home of the key set
    write_legacy(w.r, "acme", key_id, "2026-03-02", requests=2)
    write_legacy(w.r, "gone", "feedfeedfeedfeed", "2026-03-02", requests=9)  # a deleted tenant's

    assert w.store.migrate_legacy_keys() == 6 + 6
    legacy = keys(w.r, "lp:usage:*") | keys(w.r, "lp:rl:*") | keys(w.r, "lp:tenant:*:keys")
    assert legacy == set()
    assert [k["id"] for k in w.store.list_keys("acme")] == [key_id]
    assert w.store.authenticate(key) == acme
    assert _counters(w.usage.get(acme, now=DAY)["total"]) == {
        "requests": 2, "prompt_tokens": 10, "completion_tokens": 20}
    assert 90 * 86400 < w.r.ttl(f"lp:t:{acme.id}:usage:2026-03-02") <= 91 * 86400
    assert w.limiter.current(acme) == {"window_seconds": 60.0, "requests_in_window": 1,
                                       "tokens_in_window": 7, "concurrent_requests": 1}
    assert 0 < w.r.ttl(f"lp:t:{acme.id}:rl:win") <= 180

    before = {k: w.r.dump(k) for k in keys(w.r)}
    assert w.store.migrate_legacy_keys() == 0  # idempotent
    assert {k: w.r.dump(k) for k in keys(w.r)} == before
    w.store.delete("acme")  # migrated usage was indexed, so deleting finds it
    assert keys(w.r, "lp:t:*") == set()


def test_migration_merges_into_keys_the_id_already_has(w: SimpleNamespace) -> None:
    acme = w.store.create("acme")
    new_key_id, _ = w.store.create_key("acme")
    w.usage.record(acme, 1, 1, now=DAY)
    w.limiter.admit(acme, "new", 1)
    write_legacy(w.r, "acme", "0123456789abcdef", "2026-03-02", requests=3)
    w.store.migrate_legacy_keys()
    assert w.limiter.current(acme) == {"window_seconds": 60.0, "requests_in_window": 2,
                                       "tokens_in_window": 8, "concurrent_requests": 2}
    assert all(0 < w.r.ttl(k) <= 180 for k in keys(w.r, f"lp:t:{acme.id}:rl:*"))
    assert sorted(k.decode() for k in w.r.smembers(f"lp:t:{acme.id}:keys")) == \
        sorted([new_key_id, "0123456789abcdef"])
    assert _counters(w.usage.get(acme, now=DAY)["total"]) == {
        "requests": 4, "prompt_tokens": 11, "completion_tokens": 21}
    assert 90 * 86400 < w.r.ttl(f"lp:t:{acme.id}:usage:2026-03-02") <= 91 * 86400


def test_registry_migration_moves_the_index_to_the_id(w: SimpleNamespace) -> None:
    # Versions before ids wrote the index under the name, and records naming it.
    a, b = put(w.reg, "acme", "a", 1), put(w.reg, "acme", "b", 2)
    gone = put(w.reg, "gone", "x", 3)
    w.r.rename("lp:ad:idx:t:acme", "lp:ad:idx:acme")
    w.r.rename("lp:ad:idx:t:gone", "lp:ad:idx:gone")
    assert w.reg.legacy_index_names() == ["acme", "gone"]
    tid = w.store.create("acme").id

    assert w.reg.migrate_legacy_index("acme", tid) == 2
    assert [(r.name, r.version, r.tenant) for r in w.reg.list(tid)] == \
        [("a", a.version, tid), ("b", b.version, tid)]
    assert w.reg.get_version(a.version, tenant_id=tid) is not None
    assert w.reg.migrate_legacy_index("acme", tid) == 0  # idempotent
    assert w.reg.count(tid) == 2 and w.reg.legacy_index_names() == ["gone"]

    # A name with no tenant any more: its adapters are retired and freed.
    assert [r.version for r in w.reg.purge_legacy_index("gone")] == [gone.version]
    assert w.reg.legacy_index_names() == []
    w.clock.now += GRACE
    assert w.reg.collect_garbage() == 1
    assert not keys(w.r, f"lp:ad:ver:{gone.version}")


def test_registry_migration_merges_and_retires_the_displaced_version(w: SimpleNamespace) -> None:
    tid = "00000000000000e5"
    current = put(w.reg, tid, "sql", 1)  # the id-keyed index already exists
    old_sql, extra = put(w.reg, "acme", "sql", 2), put(w.reg, "acme", "extra", 3)
    w.r.rename("lp:ad:idx:t:acme", "lp:ad:idx:acme")
    pubsub = w.r.pubsub()
    pubsub.subscribe(w.reg.events_channel)
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"

    assert w.reg.migrate_legacy_index("acme", tid) == 1
    assert events(pubsub, 1) == [{"event": "deleted", "tenant": tid, "name": "sql",
                                  "version": old_sql.version}]
    pubsub.close()
    assert {r.name: r.version for r in w.reg.list(tid)} == {
        "sql": current.version, "extra": extra.version}
    w.clock.now += GRACE
    assert w.reg.collect_garbage() == 1
    assert w.reg.get_version(old_sql.version) is None
