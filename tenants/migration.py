"""Moves what versions before tenant ids keyed by tenant *name* (the key-id set,
usage hashes, limiter keys) to the id-keyed layout (see Keyspace).

Safe to run at every start: a pass that finds no legacy key changes nothing.
If an id-keyed key already exists (a process of the older version wrote the
legacy one after a first pass), the two are merged rather than one dropped:
sets and ZSETs by union, hashes and counters by adding, since every value in
those keys is an integer count or charge keyed by a unique member. Legacy
keys of a name that has no tenant any more belonged to a deleted tenant:
nothing reads them, so they are deleted.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable

import redis

from tenants.errors import TenantConcurrentChange
from tenants.models import Keyspace, TENANT_NAME_RE, Tenant, as_str

_DAY_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
_ATTEMPTS = 3

# KEYS: tenant hash, usage index, then (legacy key, id-keyed key) pairs.
# ARGV: the id the caller read, then per pair 1 if it is a usage hash.
# Returns how many legacy keys were moved, or -1 if the tenant no longer has
# that id (the caller re-reads and retries).
_MOVE = """
if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[1] then return -1 end
local now = tonumber(redis.call('TIME')[1])
local function merge(src, dst)
  if redis.call('EXISTS', dst) == 0 then
    redis.call('RENAME', src, dst)
    return
  end
  local ttl_src, ttl_dst = redis.call('PTTL', src), redis.call('PTTL', dst)
  local kind = redis.call('TYPE', src)['ok']
  if kind == 'set' then
    redis.call('SUNIONSTORE', dst, dst, src)
  elseif kind == 'zset' then
    redis.call('ZUNIONSTORE', dst, 2, dst, src, 'AGGREGATE', 'MAX')
  elseif kind == 'hash' then
    local f = redis.call('HGETALL', src)
    for j = 1, #f, 2 do redis.call('HINCRBY', dst, f[j], f[j + 1]) end
  else
    redis.call('INCRBY', dst, redis.call('GET', src))
  end
  redis.call('DEL', src)
  -- the union commands drop dst's expiry: keep the later one, or none if either had none
  if ttl_src > 0 and ttl_dst > 0 then
    redis.call('PEXPIRE', dst, math.max(ttl_src, ttl_dst))
  else
    redis.call('PERSIST', dst)
  end
end
local moved = 0
for i = 3, #KEYS, 2 do
  local src, dst = KEYS[i], KEYS[i + 1]
  if redis.call('EXISTS', src) == 1 then
    merge(src, dst)
    moved = moved + 1
    if ARGV[(i - 1) / 2 + 1] == '1' then
      local ttl = redis.call('PTTL', dst)
      local expires = ttl > 0 and tostring(now + ttl / 1000) or '+inf'
      redis.call('ZADD', KEYS[2], expires, dst)
      if ttl > 0 and redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
    end
  end
end
return moved
"""

# KEYS: tenant hash, then legacy keys of that name. Returns how many existed,
# or -1 if the name has a tenant again (the caller re-reads and retries).
_DROP = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local n = 0
for i = 2, #KEYS do n = n + redis.call('DEL', KEYS[i]) end
return n
"""


class LegacyKeyMigration:
    def __init__(self, client: redis.Redis, keyspace: Keyspace) -> None:
        self._r = client
        self._ks = keyspace
        self._move = client.register_script(_MOVE)
        self._drop = client.register_script(_DROP)

    def run(self, names: Iterable[str], get: Callable[[str], Tenant | None]) -> int:
        """Migrate the tenants called `names` (and any name only legacy usage
        still mentions); `get` reads a tenant by name. Returns how many legacy
        keys were moved or deleted."""
        usage = self._legacy_usage_keys()
        return sum(self._migrate(name, usage.get(name, []), get)
                   for name in sorted(set(names) | set(usage)))

    def _migrate(self, name: str, usage: list[tuple[str, str]],
                 get: Callable[[str], Tenant | None]) -> int:
        legacy = [self._ks.legacy_tenant_keys(name), *self._ks.legacy_limit_keys(name)]
        for _ in range(_ATTEMPTS):
            tenant = get(name)
            if tenant is None:
                done = self._drop(keys=[self._ks.tenant(name), *legacy, *(k for k, _ in usage)])
            else:
                pairs = list(zip(legacy, [self._ks.tenant_keys(tenant.id),
                                          *self._ks.limit_keys(tenant.id)]))
                pairs += [(key, self._ks.usage(tenant.id, day)) for key, day in usage]
                flags = ["0"] * len(legacy) + ["1"] * len(usage)
                done = self._move(
                    keys=[self._ks.tenant(name), self._ks.usage_index(tenant.id),
                          *(k for pair in pairs for k in pair)],
                    args=[tenant.id, *flags])
            if int(done) >= 0:
                return int(done)
        raise TenantConcurrentChange(
            f"tenant {name!r} was deleted or recreated {_ATTEMPTS} times during its migration")

    def _legacy_usage_keys(self) -> dict[str, list[tuple[str, str]]]:
        """name -> [(legacy usage key, day)], found with one SCAN."""
        start = len(self._ks.legacy_usage_prefix())
        found: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for raw in self._r.scan_iter(match=self._ks.legacy_usage_pattern(), count=1000):
            key = as_str(raw)
            name, _, day = key[start:].partition(":")
            # Anything else under the prefix is not a usage hash we wrote.
            if TENANT_NAME_RE.fullmatch(name) and _DAY_RE.fullmatch(day):
                found[name].append((key, day))
        return found
