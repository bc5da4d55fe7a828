"""CompileBudget: the seconds of grammar compile processes each tenant spent in the rate window,
in Redis (one budget across every process sharing it). A compile costs its process's time whether
it succeeds, fails or is killed at its deadline, so each is charged; past the budget a tenant's
new constraints are refused (429, Retry-After the window's end) while its cached ones still serve.

The window is fixed, opened by the tenant's first charge and lasting `window_seconds` (the key's
expiry), so an idle tenant holds no key."""
from __future__ import annotations

import math

import redis

from tenants.errors import QuotaExceeded
from tenants.models import Keyspace, Tenant, as_str

LIMIT_NAME = "compile_seconds_per_minute"


class CompileBudget:
    def __init__(self, client: redis.Redis, prefix: str, window_seconds: float) -> None:
        assert window_seconds > 0
        self._r = client
        self._ks = Keyspace(prefix)
        self._window_ms = max(1, int(window_seconds * 1000))

    def check(self, tenant: Tenant, limit_seconds: float) -> None:
        """QuotaExceeded when the tenant spent `limit_seconds` or more in its current window."""
        key = self._ks.compile_seconds(tenant.id)
        with self._r.pipeline(transaction=False) as p:
            spent, ttl_ms = p.get(key).pttl(key).execute()
        if spent is None or float(as_str(spent)) < limit_seconds:
            return
        retry_after = max(1, math.ceil((ttl_ms if ttl_ms > 0 else self._window_ms) / 1000))
        raise QuotaExceeded(
            f"tenant {tenant.name!r} spent its {LIMIT_NAME} of {limit_seconds:g} s compiling constraints "
            f"(--compile-seconds-per-minute); cached constraints still serve; retry after {retry_after} s",
            retry_after, LIMIT_NAME)

    def charge(self, tenant_id: str, seconds: float) -> None:
        key = self._ks.compile_seconds(tenant_id)
        with self._r.pipeline(transaction=True) as p:
            _, ttl_ms = p.incrbyfloat(key, float(seconds)).pttl(key).execute()
        if ttl_ms < 0:  # this charge opened the window (two that race both set the same expiry)
            self._r.pexpire(key, self._window_ms)
