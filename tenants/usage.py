"""UsageLog: per-tenant, per-UTC-day request and token counters in Redis hashes."""
from __future__ import annotations

import datetime as dt
import time
from typing import Any

import redis

from tenants.keyspace import Keyspace, as_str
from tenants.models import Tenant

_COUNTERS = ("requests", "prompt_tokens", "completion_tokens")


def _day(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d")


def _tenant_name(tenant: Tenant | str) -> str:
    return tenant.name if isinstance(tenant, Tenant) else tenant


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class UsageLog:
    def __init__(self, client: redis.Redis, prefix: str = "lp:", retention_days: int = 90) -> None:
        if not isinstance(retention_days, int) or retention_days < 1:
            raise ValueError(f"retention_days must be an int >= 1, got {retention_days!r}")
        self._r = client
        self._ks = Keyspace(prefix)
        self.retention_days = retention_days

    def record(self, tenant: Tenant | str, prompt_tokens: int, completion_tokens: int,
               requests: int = 1, now: float | None = None) -> None:
        name = _tenant_name(tenant)
        deltas = {"requests": _count("requests", requests),
                  "prompt_tokens": _count("prompt_tokens", prompt_tokens),
                  "completion_tokens": _count("completion_tokens", completion_tokens)}
        key = self._ks.usage(name, _day(time.time() if now is None else now))
        pipe = self._r.pipeline(transaction=True)
        for field, delta in deltas.items():
            pipe.hincrby(key, field, delta)
        # Kept a day past retention so the oldest day reported is still complete.
        pipe.expire(key, (self.retention_days + 1) * 86400)
        pipe.execute()

    def get(self, tenant: Tenant | str, days: int = 1, now: float | None = None) -> dict[str, Any]:
        """{"days": [{"date", "requests", "prompt_tokens", "completion_tokens"}, ...] oldest
        first, ending today (UTC), and "total": the sums over those days}."""
        if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= self.retention_days:
            raise ValueError(f"days must be an int in 1..{self.retention_days}, got {days!r}")
        name = _tenant_name(tenant)
        today = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc).date()
        dates = [(today - dt.timedelta(days=i)).isoformat() for i in range(days - 1, -1, -1)]
        pipe = self._r.pipeline(transaction=False)
        for date in dates:
            pipe.hmget(self._ks.usage(name, date), *_COUNTERS)
        per_day = []
        total = dict.fromkeys(_COUNTERS, 0)
        for date, values in zip(dates, pipe.execute()):
            row = {c: int(as_str(v) or 0) for c, v in zip(_COUNTERS, values)}
            for c in _COUNTERS:
                total[c] += row[c]
            per_day.append({"date": date, **row})
        return {"days": per_day, "total": total}
