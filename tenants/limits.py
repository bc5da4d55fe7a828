"""What a tenant may spend and what it spent, kept in Redis: the rate limits, each shared by every
replica that shares the Redis: a tenant's requests, tokens and concurrent requests (Limiter), its
grammar compile seconds (CompileBudget), and failed authentications per client address and key id
(AuthThrottle); and its usage (UsageLog).

Limiter: requests/tokens per minute and concurrent requests per tenant,
enforced atomically in Redis (see limits_lua.py for the data layout).

Time: `now=None` (the normal case) uses Redis's clock inside the script, so
processes with skewed clocks share one consistent window; tests pass `now`.
Leases: a concurrency slot is a member `<holder>/<request id>#<random>` of the tenant's lease
set, scored by its expiry. `holder` names the process that admitted it (its replica name plus a
per-process suffix), so an operator can tell whose slots a tenant holds. The holder's heartbeat
(renew(), every lease_seconds / 3 or so) keeps every lease it holds alive, however long its
request runs; a holder that stops beating (kill -9, a frozen host) loses them lease_seconds
after its last beat, when any process's admit purges them (atomically, in the admit script).

Token charges: admit() charges an estimate (prompt + max completion tokens);
release() corrects it to the actual count while the charge is still inside the
window. A request that outlives the window keeps its estimate as charged.

CompileBudget: the seconds of grammar compile processes each tenant spent in the rate window,
in Redis (one budget across every process sharing it). A compile costs its process's time whether
it succeeds, fails or is killed at its deadline, so each is charged; past the budget a tenant's
new constraints are refused (429, Retry-After the window's end) while its cached ones still serve.

The window is fixed, opened by the tenant's first charge and lasting `window_seconds` (the key's
expiry), so an idle tenant holds no key.

AuthThrottle: failed authentications counted in Redis, per client address and per key id, so
every replica sharing the Redis throttles one attacker together.

Two counters, fixed windows (INCR, and EXPIRE when the window opens): a key's traffic is small,
and a window that resets at once is good enough to stop a guessing loop. Past `limit` failures in
a window:

- an **address** is refused before its key is even checked (429 until the window ends): that
  address can no longer guess at all. A legitimate client elsewhere is unaffected; one behind
  the same address (NAT) waits with it.
- a **key id** answers its failing attempts 429 instead of 401, while the right secret still
  authenticates (the secret is checked first, in constant time): an attacker who knows a key id
  cannot lock its owner out. It does not stop a guesser spread over many addresses (nothing that
  spares the owner could); the secret's 256 random bits do that. It turns the flood into 429s the
  operator sees, and the per-address limit stops any one source.

IPv6 addresses count per /64, the block a single host is usually given.

UsageLog: per-tenant, per-UTC-day request and token counters in Redis hashes,
keyed by the tenant's id (see Keyspace).
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import math
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from tenants import limits_lua
from tenants.errors import QuotaExceeded, RequestTooLarge
from tenants.models import Keyspace, Tenant, as_str


@dataclass(frozen=True)
class Admission:
    """A granted request: its charge in the window and its concurrency lease.
    `tenant` is the tenant's id, so releasing a request that outlived its
    tenant never touches a later tenant of the same name."""

    tenant: str
    request_id: str
    slot_id: str            # the member in the window log and the lease set
    estimated_tokens: int
    admitted_at: float      # unix seconds, by the clock the limiter used
    lease_expires_at: float


def check_request_tokens(tenant: Tenant, requested_max_tokens: int, what: str = "max_tokens") -> None:
    """Refuse a request whose completion tokens (all its prompts and choices: `what` says how they
    add up) exceed the tenant's per-request cap.

    It could never succeed, so this is RequestTooLarge (HTTP 400), not QuotaExceeded.
    """
    cap = tenant.quota.max_tokens_per_request
    if cap is not None and requested_max_tokens > cap:
        raise RequestTooLarge(
            f"{what} {requested_max_tokens} exceeds this tenant's max_tokens_per_request "
            f"of {cap}", "max_tokens_per_request")


def _limit(value: int | None) -> int:
    return -1 if value is None else value


_HOLDER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
# Leases renewed per script call: bounds one call's time inside Redis.
_RENEW_BATCH = 500


class Limiter:
    def __init__(self, client: redis.Redis, prefix: str = "lp:", *,
                 window_seconds: float = 60.0, lease_seconds: float = 10.0, holder: str = "anonymous") -> None:
        """`holder` names this process's leases (a replica name); a random suffix tells apart two
        processes given the same name, or a restart from the process it replaced."""
        if not isinstance(holder, str) or not _HOLDER_RE.fullmatch(holder):
            raise ValueError(f"holder must match {_HOLDER_RE.pattern}, got {holder!r}")
        self.holder = f"{holder}.{secrets.token_hex(4)}"
        for name, value in (("window_seconds", window_seconds), ("lease_seconds", lease_seconds)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self._r = client
        self._ks = Keyspace(prefix)
        self.window_seconds = float(window_seconds)
        self.lease_seconds = float(lease_seconds)
        # Idle tenants' limiter keys vanish on their own after this long.
        self._ttl = int(math.ceil(max(self.window_seconds, self.lease_seconds))) + 60
        self._admit = client.register_script(limits_lua.ADMIT)
        self._release = client.register_script(limits_lua.RELEASE)
        self._renew = client.register_script(limits_lua.RENEW)
        self._snapshot = client.register_script(limits_lua.SNAPSHOT)
        self._cancel = client.register_script(limits_lua.CANCEL)

    def admit(self, tenant: Tenant, request_id: str, estimated_tokens: int,
              now: float | None = None) -> Admission:
        """Check rpm, tpm and concurrency and, only if all pass, record the request.

        Raises QuotaExceeded (retry later) or RequestTooLarge (estimate above the
        tokens_per_minute limit itself: it could never be admitted).
        """
        if isinstance(estimated_tokens, bool) or not isinstance(estimated_tokens, int) \
                or estimated_tokens < 0:
            raise ValueError(f"estimated_tokens must be an int >= 0, got {estimated_tokens!r}")
        quota = tenant.quota
        if quota.tokens_per_minute is not None and estimated_tokens > quota.tokens_per_minute:
            raise RequestTooLarge(
                f"this request may use up to {estimated_tokens} tokens, more than the tenant's "
                f"tokens_per_minute of {quota.tokens_per_minute}; lower max_tokens or the prompt",
                "tokens_per_minute")
        slot_id = f"{self.holder}/{request_id}#{secrets.token_hex(6)}"
        reply = self._admit(
            keys=self._ks.limit_keys(tenant.id),
            args=["" if now is None else repr(float(now)), repr(self.window_seconds),
                  repr(self.lease_seconds), slot_id, estimated_tokens,
                  _limit(quota.requests_per_minute), _limit(quota.tokens_per_minute),
                  _limit(quota.max_concurrent_requests), self._ttl])
        if int(reply[0]) == 1:
            return Admission(tenant=tenant.id, request_id=request_id, slot_id=slot_id,
                             estimated_tokens=estimated_tokens,
                             admitted_at=float(as_str(reply[1])),
                             lease_expires_at=float(as_str(reply[2])))
        limit_name = as_str(reply[1])
        retry_after = max(1, math.ceil(float(as_str(reply[2])) - 1e-6))
        value = getattr(quota, limit_name)
        raise QuotaExceeded(
            f"tenant {tenant.name!r} reached its {limit_name} limit of {value}; "
            f"retry after {retry_after} s", retry_after, limit_name)

    def release(self, admission: Admission, actual_tokens: int) -> bool:
        """Free the concurrency slot and charge actual tokens (prompt + completion)
        instead of the estimate. Safe to call twice. False if the lease had expired."""
        if isinstance(actual_tokens, bool) or not isinstance(actual_tokens, int) or actual_tokens < 0:
            raise ValueError(f"actual_tokens must be an int >= 0, got {actual_tokens!r}")
        held = self._release(keys=self._ks.limit_keys(admission.tenant),
                             args=[admission.slot_id, actual_tokens])
        return int(held) == 1

    def cancel(self, admission: Admission) -> None:
        """Undo an admission whose request was refused before it ran: it no longer counts in the
        window (requests or tokens) and its concurrency slot is free. Safe to call twice."""
        self._cancel(keys=self._ks.limit_keys(admission.tenant), args=[admission.slot_id])

    def renew(self, admissions: Sequence[Admission], now: float | None = None) -> list[Admission]:
        """The heartbeat: extend every lease in `admissions` to lease_seconds from now, in one
        round trip per few hundred. Returns those already gone (released, or reclaimed after a
        silence longer than lease_seconds); they are not brought back."""
        lost: list[Admission] = []
        for start in range(0, len(admissions), _RENEW_BATCH):
            batch = admissions[start:start + _RENEW_BATCH]
            gone = self._renew(keys=[self._ks.leases(a.tenant) for a in batch],
                               args=["" if now is None else repr(float(now)), repr(self.window_seconds),
                                     repr(self.lease_seconds), self._ttl, *(a.slot_id for a in batch)])
            lost.extend(batch[int(i) - 1] for i in gone)
        return lost

    def current(self, tenant: Tenant, now: float | None = None) -> dict[str, Any]:
        """What the tenant has in the window now (for /v1/usage)."""
        if not isinstance(tenant, Tenant):
            raise TypeError(f"expected a Tenant, got {type(tenant).__name__}")
        nreq, used, nconc = self._snapshot(
            keys=self._ks.limit_keys(tenant.id),
            args=["" if now is None else repr(float(now)), repr(self.window_seconds)])
        return {"window_seconds": self.window_seconds, "requests_in_window": int(nreq),
                "tokens_in_window": int(used), "concurrent_requests": int(nconc)}


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


# KEYS: a counter. ARGV: limit. The milliseconds its window still runs while the counter is at
# the limit or above, else 0.
_BLOCKED = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n < tonumber(ARGV[1]) then return 0 end
return math.max(redis.call('PTTL', KEYS[1]), 1)
"""

# KEYS: counters (the address's, then the key id's if any). ARGV: window in ms, limit. Counts one
# failure on each; returns the longest remaining window among those now over the limit (ms), or 0.
_FAILED = """
local wait = 0
for i = 1, #KEYS do
  local n = redis.call('INCR', KEYS[i])
  local ttl = redis.call('PTTL', KEYS[i])
  if ttl < 0 then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    ttl = tonumber(ARGV[1])
  end
  if n > tonumber(ARGV[2]) and ttl > wait then wait = ttl end
end
return wait
"""


def address_bucket(address: str | None) -> str:
    """What one client is counted as: the IPv4 address, the IPv6 /64, or the text as given."""
    if not address:
        return "unknown"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:64]
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def _seconds(ms: int) -> int | None:
    return None if ms <= 0 else max(1, math.ceil(ms / 1000))


class AuthThrottle:
    def __init__(self, client: redis.Redis, prefix: str = "lp:", *, limit: int = 30,
                 window_seconds: float = 60.0) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        if not window_seconds > 0:
            raise ValueError(f"window_seconds must be > 0, got {window_seconds!r}")
        self._ks = Keyspace(prefix)
        self.limit = limit
        self.window_seconds = float(window_seconds)
        self._blocked = client.register_script(_BLOCKED)
        self._failed = client.register_script(_FAILED)

    def blocked(self, address: str | None) -> int | None:
        """Seconds until this address may try again, or None: it is under the limit."""
        return _seconds(int(self._blocked(keys=[self._ks.auth_failures_by_address(address_bucket(address))],
                                          args=[self.limit])))

    def failed(self, address: str | None, key_id: str | None) -> int | None:
        """Count a failed authentication from `address` (against `key_id`, a well-formed key's id,
        when there was one). Seconds to wait when that puts either over the limit, else None."""
        keys = [self._ks.auth_failures_by_address(address_bucket(address))]
        if key_id is not None:
            keys.append(self._ks.auth_failures_by_key(key_id))
        return _seconds(int(self._failed(keys=keys, args=[int(self.window_seconds * 1000), self.limit])))


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
