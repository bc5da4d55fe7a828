"""RefusalLog: per-tenant, per-UTC-day counts of refused requests (429s and errors) by reason, in Redis
hashes keyed by the tenant's id (see Keyspace), so an operator sees who is being turned away and why.

The reasons are a fixed set (REASONS): a caller cannot grow the key space, whatever it sends. Each
day's hash joins the tenant's usage index, so deleting the tenant deletes it (TenantStore.delete).
"""
from __future__ import annotations

import datetime as dt
import time
from typing import Any

import redis

from tenants.models import Keyspace, Tenant, as_str

# The rate limits a 429 names (tenants.limits), then one reason per kind of refusal.
REASONS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "compile_seconds_per_minute",
           "invalid_request",
           "too_large", "forbidden", "not_found", "conflict", "unavailable", "server_error")

# KEYS: tenant hash, the day's refusal hash, the tenant's usage index. ARGV: tenant id, ttl seconds, reason.
# Written only while this tenant (its id, not just its name) exists: a refusal answered after the tenant
# was deleted must leave nothing behind that no deletion would find.
_RECORD = """
if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[1] then return 0 end
local ttl = tonumber(ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('EXPIRE', KEYS[2], ttl)
local now = tonumber(redis.call('TIME')[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZADD', KEYS[3], now + ttl, KEYS[2])
redis.call('EXPIRE', KEYS[3], ttl)
return 1
"""


def _dates(days: int, now: float | None) -> list[str]:
    today = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc).date()
    return [(today - dt.timedelta(days=i)).isoformat() for i in range(days - 1, -1, -1)]


class RefusalLog:
    def __init__(self, client: redis.Redis, prefix: str = "lp:", retention_days: int = 90) -> None:
        if isinstance(retention_days, bool) or not isinstance(retention_days, int) or retention_days < 1:
            raise ValueError(f"retention_days must be an int >= 1, got {retention_days!r}")
        self._r = client
        self._ks = Keyspace(prefix)
        self.retention_days = retention_days
        self._record = client.register_script(_RECORD)

    def record(self, tenant: Tenant, reason: str, now: float | None = None) -> bool:
        """Count one refusal of `tenant` for `reason` (one of REASONS) on the UTC day of `now`.
        False (and nothing written) if the tenant has been deleted meanwhile."""
        if not isinstance(tenant, Tenant):
            raise TypeError(f"expected a Tenant, got {type(tenant).__name__}")
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {', '.join(REASONS)}, got {reason!r}")
        day = _dates(1, now)[0]
        written = self._record(keys=[self._ks.tenant(tenant.name), self._ks.refusals(tenant.id, day),
                                     self._ks.usage_index(tenant.id)],
                               args=[tenant.id, (self.retention_days + 1) * 86400, reason])
        return int(written) == 1

    def get(self, tenant: Tenant, days: int = 1, now: float | None = None) -> dict[str, Any]:
        """{"days": [{"date", "refused", "reasons": {reason: count}}, ...] oldest first, ending today (UTC),
        and "total": {"refused", "reasons"} over those days}. A reason never refused is absent."""
        if not isinstance(tenant, Tenant):
            raise TypeError(f"expected a Tenant, got {type(tenant).__name__}")
        if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= self.retention_days:
            raise ValueError(f"days must be an int in 1..{self.retention_days}, got {days!r}")
        dates = _dates(days, now)
        pipe = self._r.pipeline(transaction=False)
        for date in dates:
            pipe.hgetall(self._ks.refusals(tenant.id, date))
        per_day, total = [], {}
        for date, fields in zip(dates, pipe.execute()):
            reasons = {r: int(as_str(v)) for k, v in fields.items() if (r := as_str(k)) in REASONS}
            for r, n in reasons.items():
                total[r] = total.get(r, 0) + n
            per_day.append({"date": date, "refused": sum(reasons.values()), "reasons": reasons})
        return {"days": per_day, "total": {"refused": sum(total.values()), "reasons": total}}
