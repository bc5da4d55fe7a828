"""The Redis tier of DoRA scales: a version's per-output scales m / ||W + s B A||, kept beside its files.

The scales depend on the adapter version (immutable) and on the base weights as a process serves them,
so they are stored per (version, base identity): one hash per version, `P ad:dora:{version}`, a field
per base identity (the engine's fingerprint of its served weights, server.engine.lora.dora_scale_cache).
Another replica with the same base, or this one after its host tier evicted the adapter or after a
restart, reads them instead of computing them again (a W A^T over every targeted projection).

Lifetime is the version's: the registry's garbage collection deletes the hash in the same script that
deletes the version record (adapters.registry_scripts), and a write lands only while that record
exists, atomically, so a load that finishes after its version was collected cannot leave scales behind.
Size is bounded: a field is [sum of the DoRA modules' out_features] float32, as large as the magnitude
vectors the upload's size_bytes counts, and at most MAX_BASES base identities are kept per version.

This is a cache of derived values: the engine validates what it reads (length, finite values) and
computes afresh whatever is missing or refused.
"""
from __future__ import annotations

from adapters.chunks import RegistryKeys

# Base identities kept per version: replicas of one deployment share one; a few more cover a rollout of
# another dtype or quantization. Past it, further bases compute their scales and do not store them.
MAX_BASES = 4
# Redis refuses values above 512 MiB; a DoRA adapter on every projection of a 70B model is ~3 MiB.
MAX_SCALE_BYTES = 256 << 20

# KEYS: the version record, its scales hash. ARGV: base identity, scales bytes, MAX_BASES.
# Returns 1 stored, 0 the version is gone (collected), -1 already MAX_BASES other bases.
_PUT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 and redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[3]) then
  return -1
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""


class DoraScaleStore:
    """`redis`: a client with decode_responses=False; `prefix`: the adapter registry's (adapters.registry)."""

    def __init__(self, redis, prefix: str = "lp:") -> None:
        self._redis = redis
        self._keys = RegistryKeys(prefix)
        self._put = redis.register_script(_PUT_LUA)

    def get(self, version: str, base: str) -> bytes | None:
        """The scales stored for `version` against `base`, or None."""
        return self._redis.hget(self._keys.dora_scales(version), base)

    def put(self, version: str, base: str, data: bytes) -> bool:
        """Store `version`'s scales against `base`; False when the version is gone or already has MAX_BASES
        other bases."""
        if len(data) > MAX_SCALE_BYTES:
            raise ValueError(f"DoRA scales of {len(data)} bytes exceed {MAX_SCALE_BYTES}")
        stored = self._put(keys=[self._keys.version(version), self._keys.dora_scales(version)],
                           args=[base, data, MAX_BASES])
        return int(stored) == 1

    def bytes_used(self, version: str) -> int:
        """Bytes of scales stored for `version`, every base together (memory accounting)."""
        key = self._keys.dora_scales(version)
        fields = self._redis.hkeys(key)
        if not fields:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for field in fields:
            pipe.hstrlen(key, field)
        return sum(pipe.execute())
