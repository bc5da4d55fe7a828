"""The Redis adapter registry against a real redis-server."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import pytest
import redis

from adapters.references import AdapterReference, ReferenceStore
from adapters.registry import (AdapterCorrupted, AdapterExists, AdapterNotFound,
                               AdapterQuotaExceeded, AdapterRecord, AdapterRegistry)

pytestmark = pytest.mark.unit

GRACE = 60.0


# ---- helpers ----
# The registry names tenants by opaque ids (tenants mints 16 hex digits); short
# ones like "acme" read better here and are just as valid to it.

@dataclass(frozen=True)
class Summary:
    rank: int = 8
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    size_bytes: int = 1234


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def payload(seed: int, n: int) -> bytes:
    return bytes((seed * 31 + i * 7 + (i >> 8)) % 256 for i in range(n))


CONFIG = b'{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}'


def keys(r, pattern: str = "lp:*") -> list[str]:
    return sorted(k.decode() for k in r.scan_iter(pattern))


def chunk_keys(r) -> list[str]:
    return keys(r, "lp:ad:chunk:*")


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def reg(redis_client, clock):
    return AdapterRegistry(redis_client, chunk_size=64, grace_seconds=GRACE, clock=clock)


# ---- basic CRUD ----

def test_put_get_list_delete(reg, redis_client):
    rec = reg.put("acme", "sql", CONFIG, payload(1, 300), summary=Summary(rank=16))
    assert isinstance(rec, AdapterRecord) and len(rec.version) == 32
    assert (rec.tenant, rec.name, rec.rank, rec.target_modules, rec.size_bytes) == \
        ("acme", "sql", 16, ("q_proj", "v_proj"), 1234)
    assert reg.get("acme", "sql") == rec
    assert reg.get_version(rec.version) == rec
    assert reg.get("acme", "nope") is None
    reg.put("acme", "alpha", CONFIG, payload(2, 10), summary=Summary())
    assert [r.name for r in reg.list("acme")] == ["alpha", "sql"]
    assert reg.count("acme") == 2
    pub = rec.public()
    assert pub == {"id": rec.version, "name": "sql", "version": rec.version, "rank": 16,
                   "target_modules": ["q_proj", "v_proj"], "size_bytes": 1234,
                   "created_at": rec.created_at, "base": None}
    assert reg.delete("acme", "sql") == rec
    assert reg.get("acme", "sql") is None
    assert reg.delete("acme", "sql") is None
    assert reg.count("acme") == 1 and [r.name for r in reg.list("acme")] == ["alpha"]


@pytest.mark.parametrize("bad", ["", "-x", ".x", "a/b", "a b", "a:b", "x" * 65, "é"])
def test_bad_names_rejected(reg, bad):
    with pytest.raises(ValueError):
        reg.put("acme", bad, CONFIG, b"w", summary=Summary())
    with pytest.raises(ValueError):
        reg.get("acme", bad)


def test_longest_name_accepted(reg):
    name = "A" + "b._-" * 15 + "xyz"
    assert len(name) == 64
    assert reg.put("acme", name, CONFIG, b"w", summary=Summary()).name == name


def test_decode_responses_client_refused(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        AdapterRegistry(client)
    client.close()


def test_read_files_round_trip_multi_chunk(reg, redis_client):
    weights = payload(3, 64 * 10 + 17)  # 11 chunks, the last one short
    config = payload(4, 130)
    rec = reg.put("acme", "big", config, weights, summary=Summary())
    assert reg.read_files(rec.version) == (config, weights)
    assert len(chunk_keys(redis_client)) == 11 + 3
    assert keys(redis_client, "lp:ad:stage:*") == []
    empty = reg.put("acme", "empty", b"", b"", summary=Summary())
    assert reg.read_files(empty.version) == (b"", b"")
    with pytest.raises(AdapterNotFound):
        reg.read_files("0" * 32)
    with pytest.raises(AdapterNotFound):
        reg.read_files("../../etc")


def test_corrupted_chunk_detected(reg, redis_client):
    rec = reg.put("acme", "x", CONFIG, payload(5, 200), summary=Summary())
    key = chunk_keys(redis_client)[0]
    redis_client.hset(key, "data", b"garbage")
    with pytest.raises(AdapterCorrupted):
        reg.read_files(rec.version)


def test_identical_payloads_share_chunks(reg, redis_client, clock):
    weights = payload(6, 64 * 5)
    a = reg.put("acme", "a", CONFIG, weights, summary=Summary())
    n_chunks = len(chunk_keys(redis_client))
    b = reg.put("acme", "b", CONFIG, weights, summary=Summary())
    c = reg.put("other", "c", CONFIG, weights, summary=Summary())
    assert len({a.version, b.version, c.version}) == 3
    assert len(chunk_keys(redis_client)) == n_chunks
    assert {int(redis_client.hget(k, "refs")) for k in chunk_keys(redis_client)} == {3}
    reg.delete("acme", "a")
    reg.delete("acme", "b")
    clock.now += GRACE + 1
    assert reg.collect_garbage() == 2
    assert len(chunk_keys(redis_client)) == n_chunks
    assert reg.read_files(c.version) == (CONFIG, weights)


def test_repeated_chunks_inside_one_file_are_counted(reg, redis_client, clock):
    weights = b"\0" * (64 * 6)  # six identical chunks
    rec = reg.put("acme", "zeros", b"", weights, summary=Summary())
    (key,) = chunk_keys(redis_client)
    assert int(redis_client.hget(key, "refs")) == 6
    assert reg.read_files(rec.version) == (b"", weights)
    reg.delete("acme", "zeros")
    clock.now += GRACE
    reg.collect_garbage()
    assert keys(redis_client) == []


def test_tenants_are_isolated(reg):
    a = reg.put("a", "sql", CONFIG, payload(7, 100), summary=Summary(rank=4))
    b = reg.put("b", "sql", CONFIG, payload(8, 100), summary=Summary(rank=8))
    assert a.version != b.version
    assert reg.get("a", "sql") == a and reg.get("b", "sql") == b
    assert reg.get_version(a.version, tenant_id="b") is None
    assert reg.get_version(a.version, tenant_id="a") == a
    assert [r.version for r in reg.list("b")] == [b.version]
    assert reg.delete("a", "sql") == a
    assert reg.get("b", "sql") == b and reg.count("a") == 0 and reg.count("b") == 1
    assert reg.read_files(b.version) == (CONFIG, payload(8, 100))


def test_existing_name_is_409_unless_replace(reg, redis_client):
    first = reg.put("acme", "sql", CONFIG, payload(9, 100), summary=Summary())
    with pytest.raises(AdapterExists):
        reg.put("acme", "sql", CONFIG, payload(10, 100), summary=Summary())
    assert reg.get("acme", "sql") == first
    assert keys(redis_client, "lp:ad:stage:*") == []


# ---- grace period and garbage collection ----

def test_replace_keeps_old_version_readable_during_grace(reg, redis_client, clock):
    old_w, new_w = payload(11, 200), payload(12, 200)
    old = reg.put("acme", "sql", CONFIG, old_w, summary=Summary(rank=4))
    clock.now += 1
    new = reg.put("acme", "sql", CONFIG, new_w, summary=Summary(rank=8), replace=True)
    assert new.version != old.version
    assert reg.get("acme", "sql") == new and reg.count("acme") == 1
    assert [r.version for r in reg.list("acme")] == [new.version]
    clock.now += GRACE - 1  # still inside the old version's grace
    assert reg.put("acme", "other", CONFIG, b"x", summary=Summary()).name == "other"
    assert reg.get_version(old.version) == old
    assert reg.read_files(old.version) == (CONFIG, old_w)
    clock.now += 1  # grace over: gone even before collection runs
    assert reg.get_version(old.version) is None
    with pytest.raises(AdapterNotFound):
        reg.read_files(old.version)
    assert reg.collect_garbage() == 1
    assert redis_client.exists(f"lp:ad:ver:{old.version}") == 0
    new_chunks = set(json.loads(redis_client.hget(f"lp:ad:ver:{new.version}", "weights_chunks")))
    new_chunks |= set(json.loads(redis_client.hget(f"lp:ad:ver:{new.version}", "config_chunks")))
    other = reg.get("acme", "other").version
    other_chunks = set(json.loads(redis_client.hget(f"lp:ad:ver:{other}", "weights_chunks")))
    assert chunk_keys(redis_client) == sorted(f"lp:ad:chunk:{d}" for d in new_chunks | other_chunks)
    assert reg.read_files(new.version) == (CONFIG, new_w)


def test_delete_frees_everything_after_grace(reg, redis_client, clock):
    rec = reg.put("acme", "sql", CONFIG, payload(13, 500), summary=Summary())
    reg.delete("acme", "sql")
    assert reg.read_files(rec.version)[1] == payload(13, 500)
    clock.now += GRACE / 2
    assert reg.collect_garbage() == 0
    clock.now += GRACE / 2
    reg.put("acme", "next", b"", b"", summary=Summary())  # a put collects too
    reg.delete("acme", "next")
    clock.now += GRACE
    reg.delete("acme", "absent")  # and so does a delete
    assert keys(redis_client) == []



def test_medusa_heads_are_stored_with_their_version_and_freed_with_it(reg, redis_client, clock):
    heads = (b'{"num_heads": 2}', payload(21, 3000))
    rec = reg.put("acme", "sql", CONFIG, payload(13, 500), summary=Summary(), medusa=heads)
    plain = reg.put("acme", "other", CONFIG, payload(14, 500), summary=Summary())
    assert reg.read_medusa(rec.version) == heads and reg.read_medusa(plain.version) is None
    assert reg.read_files(rec.version) == (CONFIG, payload(13, 500))
    reg.delete("acme", "sql")
    reg.delete("acme", "other")
    clock.now += GRACE * 2
    assert reg.collect_garbage() == 2
    assert keys(redis_client) == [], "the heads' chunks went with their version"
    with pytest.raises(AdapterNotFound):
        reg.read_medusa(rec.version)


def test_a_draft_lora_is_stored_with_its_version_beside_heads_and_freed_with_it(reg, redis_client, clock):
    heads = (b'{"num_heads": 2}', payload(21, 3000))
    draft = (b'{"r": 8}', payload(22, 2000))
    rec = reg.put("acme", "sql", CONFIG, payload(13, 500), summary=Summary(), medusa=heads, draft=draft)
    only = reg.put("acme", "other", CONFIG, payload(14, 500), summary=Summary(), draft=draft)
    assert reg.read_draft(rec.version) == draft and reg.read_medusa(rec.version) == heads
    assert reg.read_draft(only.version) == draft and reg.read_medusa(only.version) is None
    reg.delete("acme", "sql")
    clock.now += GRACE * 2
    assert reg.collect_garbage() == 1
    assert reg.read_draft(only.version) == draft, "shared chunks stay while another version holds them"
    reg.delete("acme", "other")
    clock.now += GRACE * 2
    assert reg.collect_garbage() == 1
    assert keys(redis_client) == [], "the draft LoRA's chunks went with their version"


# ---- quota ----

def test_max_adapters_enforced(reg):
    reg.put("acme", "a", CONFIG, b"1", summary=Summary(), max_adapters=2)
    reg.put("acme", "b", CONFIG, b"2", summary=Summary(), max_adapters=2)
    with pytest.raises(AdapterQuotaExceeded) as info:
        reg.put("acme", "c", CONFIG, b"3", summary=Summary(), max_adapters=2)
    assert info.value.limit_name == "max_adapters" and info.value.limit == 2
    # replacing does not add an adapter, and other tenants have their own count
    reg.put("acme", "a", CONFIG, b"4", summary=Summary(), max_adapters=2, replace=True)
    reg.put("other", "c", CONFIG, b"3", summary=Summary(), max_adapters=2)
    reg.delete("acme", "b")
    reg.put("acme", "c", CONFIG, b"3", summary=Summary(), max_adapters=2)
    assert reg.count("acme") == 2


def _race(n: int, fn) -> list:
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as exc:  # collected and asserted by the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_max_adapters_holds_under_concurrency(reg, redis_client):
    results = _race(8, lambda i: reg.put("acme", f"n{i}", CONFIG, payload(20 + i, 150),
                                         summary=Summary(), max_adapters=3))
    ok = [r for r in results if isinstance(r, AdapterRecord)]
    refused = [r for r in results if isinstance(r, AdapterQuotaExceeded)]
    assert len(ok) == 3 and len(refused) == 5, results
    assert reg.count("acme") == 3
    assert keys(redis_client, "lp:ad:stage:*") == []
    expected = set()
    for r in ok:
        for field in ("config_chunks", "weights_chunks"):
            expected |= set(json.loads(redis_client.hget(f"lp:ad:ver:{r.version}", field)))
    assert chunk_keys(redis_client) == sorted(f"lp:ad:chunk:{d}" for d in expected)


def test_uploads_and_references_share_max_adapters_atomically(reg, redis_client):
    # Issue 43: lazy references count toward max_adapters, and neither side's check can be raced.
    refs = ReferenceStore(redis_client)
    assert refs.put_within("acme", "lazy", "s3://b/x", max_adapters=2) is not None
    reg.put("acme", "lazy", CONFIG, b"0", summary=Summary(), max_adapters=2)  # its fetch: same place
    results = _race(8, lambda i: reg.put("acme", f"up{i}", CONFIG, payload(40 + i, 150), summary=Summary(),
                                         max_adapters=2) if i % 2 else
                    refs.put_within("acme", f"ref{i}", "s3://b/y", max_adapters=2))
    won = [r for r in results if isinstance(r, (AdapterRecord, AdapterReference))]
    assert len(won) == 1, results
    names = {r.name for r in reg.list("acme")} | set(refs.list("acme"))
    assert len(names) == 2, names
    assert refs.put_within("acme", "lazy", "s3://b/z", max_adapters=2) is not None  # a replacement fits


def test_concurrent_puts_of_one_name_have_one_winner(reg, redis_client):
    results = _race(6, lambda i: reg.put("acme", "same", CONFIG, payload(40 + i, 150),
                                         summary=Summary()))
    ok = [r for r in results if isinstance(r, AdapterRecord)]
    assert len(ok) == 1 and all(isinstance(r, AdapterExists) for r in results if r is not ok[0])
    assert reg.get("acme", "same") == ok[0]
    winner = results.index(ok[0])
    assert reg.read_files(ok[0].version) == (CONFIG, payload(40 + winner, 150))
    assert len(keys(redis_client, "lp:ad:ver:*")) == 1
    assert keys(redis_client, "lp:ad:stage:*") == []
    assert len(chunk_keys(redis_client)) == -(-len(CONFIG) // 64) + 3  # only the winner's chunks


# ---- failures midway ----

class FailingCommit(AdapterRegistry):
    def _run_commit(self, *args, **kwargs):
        raise ConnectionError("connection lost before commit")


class CrashBeforeCommit(FailingCommit):
    """The process dies after staging: nothing gets to clean up."""

    def _discard(self, upload_id, staged):
        pass


class FailingMidStage(AdapterRegistry):
    def _stage(self, upload_id, payloads):
        half = dict(list(payloads.items())[: len(payloads) // 2])
        super()._stage(upload_id, half)
        raise ConnectionError("connection lost while staging")


@pytest.mark.parametrize("cls", [FailingCommit, FailingMidStage])
def test_failure_midway_leaves_nothing(redis_client, clock, cls):
    reg = cls(redis_client, chunk_size=64, grace_seconds=GRACE, clock=clock)
    with pytest.raises(ConnectionError):
        reg.put("acme", "sql", CONFIG, payload(50, 64 * 20), summary=Summary())
    assert reg.get("acme", "sql") is None and reg.count("acme") == 0
    assert keys(redis_client) == []


def test_failed_replace_keeps_the_old_version(reg, redis_client, clock):
    old = reg.put("acme", "sql", CONFIG, payload(51, 300), summary=Summary())
    before = keys(redis_client)
    failing = FailingCommit(redis_client, chunk_size=64, grace_seconds=GRACE, clock=clock)
    with pytest.raises(ConnectionError):
        failing.put("acme", "sql", CONFIG, payload(52, 300), summary=Summary(), replace=True)
    assert reg.get("acme", "sql") == old
    assert keys(redis_client) == before


def test_crash_between_staging_and_commit_expires(redis_client, clock):
    reg = CrashBeforeCommit(redis_client, chunk_size=64, grace_seconds=GRACE, clock=clock,
                            pending_ttl_seconds=0.3)
    with pytest.raises(ConnectionError):
        reg.put("acme", "sql", CONFIG, payload(53, 64 * 4), summary=Summary())
    staged = keys(redis_client)
    assert staged and all(k.startswith("lp:ad:stage:") for k in staged)
    assert all(0 < redis_client.pttl(k) <= 300 for k in staged)
    assert reg.get("acme", "sql") is None
    deadline = time.monotonic() + 5
    while keys(redis_client) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert keys(redis_client) == []


class CollectBeforeFirstCommit(AdapterRegistry):
    """Garbage collection releases the chunks this upload relied on right
    before its commit: the commit must notice and the upload resend them."""

    armed = False
    commits = 0

    def _run_commit(self, *args, **kwargs):
        self.commits += 1
        if self.armed:
            self.armed = False
            self._clock.now += GRACE  # the test clock is mutable
            assert self.collect_garbage() == 1
        return super()._run_commit(*args, **kwargs)


def test_commit_resends_chunks_collected_meanwhile(redis_client, clock):
    weights = payload(54, 64 * 3)
    reg = CollectBeforeFirstCommit(redis_client, chunk_size=64, grace_seconds=GRACE, clock=clock)
    reg.put("acme", "old", CONFIG, weights, summary=Summary())
    reg.delete("acme", "old")
    reg.armed, reg.commits = True, 0
    rec = reg.put("acme", "new", CONFIG, weights, summary=Summary())
    assert reg.commits == 2
    assert reg.read_files(rec.version) == (CONFIG, weights)
    assert {int(redis_client.hget(k, "refs")) for k in chunk_keys(redis_client)} == {1}
    assert keys(redis_client, "lp:ad:stage:*") == []


class SlowFirstCommit(AdapterRegistry):
    """The upload stalls past the staging TTL before its first commit."""

    commits = 0

    def _run_commit(self, *args, **kwargs):
        self.commits += 1
        if self.commits == 1:
            time.sleep(0.15)
        return super()._run_commit(*args, **kwargs)


def test_commit_restages_chunks_whose_staging_expired(redis_client, clock):
    reg = SlowFirstCommit(redis_client, chunk_size=64, grace_seconds=GRACE, clock=clock,
                          pending_ttl_seconds=0.05)
    weights = payload(55, 64 * 3)
    rec = reg.put("acme", "slow", CONFIG, weights, summary=Summary())
    assert reg.commits == 2
    assert reg.read_files(rec.version) == (CONFIG, weights)
    assert all(redis_client.pttl(k) == -1 for k in chunk_keys(redis_client))


# ---- events ----

def test_events_published_on_replace_and_delete(reg, redis_client):
    pubsub = redis_client.pubsub()
    pubsub.subscribe(reg.events_channel)
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    old = reg.put("acme", "sql", CONFIG, b"1", summary=Summary())
    new = reg.put("acme", "sql", CONFIG, b"2", summary=Summary(), replace=True)
    reg.delete("acme", "sql")
    reg.delete("acme", "absent")  # no event for a name that does not exist
    messages = []
    deadline = time.monotonic() + 5
    while len(messages) < 2 and time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=0.2)
        if msg and msg["type"] == "message":
            messages.append(json.loads(msg["data"]))
    extra = pubsub.get_message(timeout=0.3)
    pubsub.close()
    assert extra is None
    assert messages[0] == {"event": "replaced", "tenant": "acme", "name": "sql",
                           "version": old.version, "new_version": new.version}
    assert messages[1] == {"event": "deleted", "tenant": "acme", "name": "sql",
                           "version": new.version}
    assert len(messages) == 2
