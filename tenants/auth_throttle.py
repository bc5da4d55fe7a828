"""AuthThrottle: failed authentications counted in Redis, per client address and per key id, so
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
"""
from __future__ import annotations

import ipaddress
import math

import redis

from tenants.models import Keyspace

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
