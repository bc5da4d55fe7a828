"""tenants.RefusalLog against a real redis-server (tests.fixtures_redis): refused requests per tenant,
per UTC day and by reason, from a fixed set of reasons; nothing is written for a deleted tenant, and
deleting a tenant deletes its counts."""
from __future__ import annotations

import datetime as dt

import pytest
import redis

from tenants import REFUSAL_REASONS, RefusalLog, Tenant, TenantStore, UsageLog
from tests.tenant_helpers import ACME_ID

pytestmark = pytest.mark.unit


def test_refusals_per_day_and_reason_are_exact(redis_client: redis.Redis) -> None:
    store, refusals = TenantStore(redis_client), RefusalLog(redis_client)
    acme, beta = store.create("acme"), store.create("beta")
    day1 = dt.datetime(2026, 3, 1, 23, 59, tzinfo=dt.timezone.utc).timestamp()
    day2 = day1 + 120  # past UTC midnight
    for _ in range(3):
        assert refusals.record(acme, "requests_per_minute", now=day1) is True
    refusals.record(acme, "not_found", now=day1)
    refusals.record(acme, "max_concurrent_requests", now=day2)
    refusals.record(beta, "invalid_request", now=day2)
    got = refusals.get(acme, days=3, now=day2)
    assert got["days"] == [
        {"date": "2026-02-28", "refused": 0, "reasons": {}},
        {"date": "2026-03-01", "refused": 4, "reasons": {"requests_per_minute": 3, "not_found": 1}},
        {"date": "2026-03-02", "refused": 1, "reasons": {"max_concurrent_requests": 1}},
    ]
    assert got["total"] == {"refused": 5, "reasons": {"requests_per_minute": 3, "not_found": 1,
                                                      "max_concurrent_requests": 1}}
    assert refusals.get(beta, now=day2)["total"] == {"refused": 1, "reasons": {"invalid_request": 1}}


def test_the_reasons_are_a_fixed_set(redis_client: redis.Redis) -> None:
    acme = TenantStore(redis_client).create("acme")
    refusals = RefusalLog(redis_client)
    for bad in ("", "anything-else", "requests_per_minute ", None, 429):
        with pytest.raises(ValueError, match="reason must be one of"):
            refusals.record(acme, bad)
    with pytest.raises(TypeError):
        refusals.record("acme", "not_found")  # a bare name could count against another incarnation
    for bad_days in (0, 91, True, 1.5):
        with pytest.raises(ValueError):
            refusals.get(acme, days=bad_days)
    assert refusals.get(acme)["total"] == {"refused": 0, "reasons": {}}
    assert len(REFUSAL_REASONS) == len(set(REFUSAL_REASONS)) == 11  # compile_seconds_per_minute added


def test_refusals_of_a_deleted_tenant_are_not_kept(redis_client: redis.Redis) -> None:
    store, refusals = TenantStore(redis_client), RefusalLog(redis_client)
    acme = store.create("acme")
    refusals.record(acme, "tokens_per_minute")
    UsageLog(redis_client).record(acme, 1, 1)
    (key,) = list(redis_client.scan_iter(f"lp:t:{acme.id}:refusals:*"))
    assert 90 * 86400 < redis_client.ttl(key) <= 91 * 86400
    assert key in redis_client.zrange(f"lp:t:{acme.id}:usage", 0, -1)  # found by the tenant's deletion
    store.delete("acme")
    assert list(redis_client.scan_iter("lp:t:*")) == []
    # A refusal answered after the deletion (or for an id that never existed) leaves nothing behind.
    assert refusals.record(acme, "not_found") is False
    assert refusals.record(Tenant(name="ghost", id=ACME_ID), "not_found") is False
    assert list(redis_client.scan_iter("lp:t:*")) == []
    again = store.create("acme")  # the name reused: a new tenant starts with none
    assert refusals.get(again)["total"]["refused"] == 0


def test_every_error_answer_maps_to_a_known_reason_or_none() -> None:
    from server.api.refusal_count import refusal_reason

    assert refusal_reason(429, "tokens_per_minute") == "tokens_per_minute"
    assert refusal_reason(429, "auth_throttled") is None  # before any tenant is known
    assert refusal_reason(422, "invalid_field") == refusal_reason(400, None) == "invalid_request"
    assert refusal_reason(413, "request_too_large") == "too_large"
    assert refusal_reason(403, "max_adapters") == "forbidden"
    assert refusal_reason(503, "engine_unavailable") == "unavailable"
    assert refusal_reason(503, "store_unavailable") is None  # Redis is down: it could not be counted
    assert refusal_reason(500, "internal_error") == refusal_reason(504, None) == "server_error"
    assert refusal_reason(401, "invalid_api_key") is None
    statuses = (400, 403, 404, 405, 409, 413, 422, 429, 500, 502, 503, 504)
    assert {refusal_reason(s, c) for s in statuses for c in (None, "requests_per_minute")} - {None} <= set(REFUSAL_REASONS)
