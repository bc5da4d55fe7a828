"""UsageLog: per-tenant, per-UTC-day request and token counters in Redis hashes,
keyed by the tenant's id (see Keyspace)."""
from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from tenants.models import Keyspace, Tenant, as_str

_COUNTERS = ("requests", "prompt_tokens", "completion_tokens")
# Per-adapter counters live in the same day hash as "a:<adapter name>:<counter>"; the base model's
# name is empty ("a::requests"). Adapter names cannot contain ':' (adapters.registry), so this parses.
_ADAPTER_FIELD = "a:"

# Adds d[1..3] (one delta per counter in _COUNTERS) to KEYS[2], the day's usage hash, under the
# adapter field prefix ARGV[6] too; ARGV[2] is its ttl. The index (KEYS[3]) scores each hash by
# its expiry so entries leave with the hashes they name.
_ADD = """
local ttl = tonumber(ARGV[2])
redis.call('HINCRBY', KEYS[2], 'requests', d[1])
redis.call('HINCRBY', KEYS[2], 'prompt_tokens', d[2])
redis.call('HINCRBY', KEYS[2], 'completion_tokens', d[3])
redis.call('HINCRBY', KEYS[2], ARGV[6] .. 'requests', d[1])
redis.call('HINCRBY', KEYS[2], ARGV[6] .. 'prompt_tokens', d[2])
redis.call('HINCRBY', KEYS[2], ARGV[6] .. 'completion_tokens', d[3])
redis.call('EXPIRE', KEYS[2], ttl)
local now = tonumber(redis.call('TIME')[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZADD', KEYS[3], now + ttl, KEYS[2])
redis.call('EXPIRE', KEYS[3], ttl)
"""

# A request that finishes after its tenant was deleted must not leave a counter behind that
# nothing would ever delete, so a write happens only while the tenant (this id, not just this
# name) still exists (KEYS[1], ARGV[1]).
_IF_TENANT = "if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[1] then return 0 end\n"

# KEYS: tenant hash, the day's usage hash, the tenant's usage index.
# ARGV: tenant id, ttl seconds, one delta per counter in _COUNTERS, then the adapter field prefix.
_RECORD = _IF_TENANT + "local d = {ARGV[3], ARGV[4], ARGV[5]}\n" + _ADD + "return 1\n"

# A running request's usage so far: KEYS as _RECORD's, then its run key, which holds what was
# recorded of it (r, p, c). ARGV as _RECORD's but with the request's totals so far instead of
# deltas, then the run key's ttl. Adds the difference only, so sending the same totals twice (a
# reply lost to a timeout, the round or the final record sent again) counts them once.
_RECORD_SO_FAR = _IF_TENANT + """
local had = redis.call('HMGET', KEYS[4], 'r', 'p', 'c')
local d = {}
for i = 1, 3 do d[i] = math.max(0, tonumber(ARGV[2 + i]) - tonumber(had[i] or '0')) end
""" + _ADD + """
redis.call('HSET', KEYS[4], 'r', ARGV[3], 'p', ARGV[4], 'c', ARGV[5])
redis.call('EXPIRE', KEYS[4], ARGV[7])
return 1
"""

# How long a run key outlives its last write: while the request runs, past any replica's death
# mid-request; once it ended, long enough for a final record whose reply was lost to be sent again
# (retries come every half second once Redis answers) while keeping ended requests' keys few.
RUN_TTL_SECONDS = 86400
ENDED_RUN_TTL_SECONDS = 600


@dataclass(frozen=True)
class RunUsage:
    """A running request's usage so far (UsageLog.record_so_far): its totals, not a delta."""

    tenant: Tenant
    run: str                # the request's own id (its lease's slot id), unique across replicas
    prompt_tokens: int
    completion_tokens: int
    requests: int = 1
    adapter: str | None = None


def _day(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d")


def _tenant(tenant: Any) -> Tenant:
    # A bare name would silently read or write another incarnation's counters.
    if not isinstance(tenant, Tenant):
        raise TypeError(f"expected a Tenant, got {type(tenant).__name__}")
    return tenant


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
        self._record = client.register_script(_RECORD)
        self._record_so_far = client.register_script(_RECORD_SO_FAR)

    def record(self, tenant: Tenant, prompt_tokens: int, completion_tokens: int,
               requests: int = 1, now: float | None = None, adapter: str | None = None) -> bool:
        """Add to the tenant's counters (and its `adapter`'s; None: the base model) for the day of
        `now`. False (and nothing written) if the tenant has been deleted meanwhile."""
        keys, args = self._record_call(tenant, prompt_tokens, completion_tokens, requests, now, adapter)
        return int(self._record(keys=keys, args=args)) == 1

    def record_so_far(self, runs: Sequence[RunUsage], final: bool = False, now: float | None = None) -> list[bool]:
        """Record running requests' usage so far, in one pipelined round trip: each adds what was not
        recorded of it yet, so the same totals sent twice count once (a round whose reply was lost is
        simply sent again). `final`: the requests ended (their run keys are kept ENDED_RUN_TTL_SECONDS). False for a request
        whose tenant was deleted. Raises RedisError when the round trip fails."""
        calls = []
        for r in runs:
            if not isinstance(r.run, str) or not r.run:
                raise ValueError(f"run must be a request id, got {r.run!r}")
            keys, args = self._record_call(r.tenant, r.prompt_tokens, r.completion_tokens, r.requests, now, r.adapter)
            calls.append(([*keys, self._ks.running_usage(r.tenant.id, r.run)],
                          [*args, ENDED_RUN_TTL_SECONDS if final else RUN_TTL_SECONDS]))
        if not calls:
            return []
        pipe = self._r.pipeline(transaction=False)
        for keys, args in calls:
            self._record_so_far(keys=keys, args=args, client=pipe)
        return [int(written) == 1 for written in pipe.execute()]

    def _record_call(self, tenant: Tenant, prompt_tokens: int, completion_tokens: int, requests: int,
                     now: float | None, adapter: str | None) -> tuple[list[str], list[Any]]:
        if adapter is not None and (not isinstance(adapter, str) or ":" in adapter or not adapter):
            raise ValueError(f"adapter must be an adapter name, got {adapter!r}")
        tenant = _tenant(tenant)
        deltas = (_count("requests", requests), _count("prompt_tokens", prompt_tokens),
                  _count("completion_tokens", completion_tokens))
        day_key = self._ks.usage(tenant.id, _day(time.time() if now is None else now))
        # Kept a day past retention so the oldest day reported is still complete.
        ttl = (self.retention_days + 1) * 86400
        return ([self._ks.tenant(tenant.name), day_key, self._ks.usage_index(tenant.id)],
                [tenant.id, ttl, *deltas, f"{_ADAPTER_FIELD}{adapter or ''}:"])

    def get(self, tenant: Tenant, days: int = 1, now: float | None = None, base_model: str = "") -> dict[str, Any]:
        """{"days": [{"date", "requests", "prompt_tokens", "completion_tokens", "adapters"}, ...]
        oldest first, ending today (UTC), and "total": the sums over those days (with "adapters")}.
        "adapters" maps an adapter name to its three counters, the base model's under `base_model`
        (its id; it is stored under "", so every record written before reads the same)."""
        tenant = _tenant(tenant)
        if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= self.retention_days:
            raise ValueError(f"days must be an int in 1..{self.retention_days}, got {days!r}")
        today = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc).date()
        dates = [(today - dt.timedelta(days=i)).isoformat() for i in range(days - 1, -1, -1)]
        pipe = self._r.pipeline(transaction=False)
        for date in dates:
            pipe.hgetall(self._ks.usage(tenant.id, date))
        per_day = []
        total: dict[str, Any] = {**dict.fromkeys(_COUNTERS, 0), "adapters": {}}
        for date, fields in zip(dates, pipe.execute()):
            values = {as_str(k): int(as_str(v)) for k, v in fields.items()}
            row: dict[str, Any] = {c: values.get(c, 0) for c in _COUNTERS}
            adapters: dict[str, dict[str, int]] = {}
            for field, value in values.items():
                if field.startswith(_ADAPTER_FIELD):
                    name, _, counter = field[len(_ADAPTER_FIELD):].rpartition(":")
                    if counter in _COUNTERS:
                        adapters.setdefault(name or base_model, dict.fromkeys(_COUNTERS, 0))[counter] += value
            for c in _COUNTERS:
                total[c] += row[c]
            for name, counters in adapters.items():
                into = total["adapters"].setdefault(name, dict.fromkeys(_COUNTERS, 0))
                for c in _COUNTERS:
                    into[c] += counters[c]
            per_day.append({"date": date, **row, "adapters": adapters})
        return {"days": per_day, "total": total}
