"""Adapters registered by reference (a source, not bytes): per tenant, name -> where to fetch it and
the content hash of the last fetch. The bytes themselves, once fetched, are an ordinary registry
version; this store is what lets the first use fetch them (lazy loading) and a re-registration tell
whether the object changed."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from adapters.chunks import RegistryKeys
from adapters.registry_scripts import _PUT_REFERENCE_LUA


@dataclass(frozen=True)
class AdapterReference:
    name: str
    source: str                 # as the client wrote it (never holds credentials: parse_reference refuses them)
    registered_at: float
    sha256: str | None = None   # content of the last fetch; None until fetched

    def public(self) -> dict:
        return {"source": self.source, "sha256": self.sha256, "fetched": self.sha256 is not None}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


class ReferenceStore:
    def __init__(self, redis, prefix: str = "lp:") -> None:
        self._redis = redis
        self._keys = RegistryKeys(prefix)
        self._put_within = redis.register_script(_PUT_REFERENCE_LUA)

    def _key(self, owner: str) -> str:
        return self._keys.references(owner)

    def put(self, owner: str, name: str, source: str, sha256: str | None = None) -> AdapterReference:
        ref = AdapterReference(name, source, time.time(), sha256)
        self._redis.hset(self._key(owner), name, json.dumps(asdict(ref)))
        return ref

    def put_within(self, owner: str, name: str, source: str, max_adapters: int) -> AdapterReference | None:
        """put, unless `name` is new to `owner` and its names (stored in the registry or referenced
        here, each counted once) already number `max_adapters`: then None and nothing written. One
        Lua script, so concurrent registrations cannot all see room."""
        ref = AdapterReference(name, source, time.time())
        written = self._put_within(keys=[self._key(owner), self._keys.index(owner)],
                                   args=[name, json.dumps(asdict(ref)), max_adapters])
        return ref if int(written) else None

    def restore(self, owner: str, ref: AdapterReference) -> None:
        """Put back a reference as it was (a replacement whose fetch failed)."""
        self._redis.hset(self._key(owner), ref.name, json.dumps(asdict(ref)))

    def get(self, owner: str, name: str) -> AdapterReference | None:
        raw = self._redis.hget(self._key(owner), name)
        return None if raw is None else AdapterReference(**json.loads(_text(raw)))

    def list(self, owner: str) -> dict[str, AdapterReference]:
        return {_text(k): AdapterReference(**json.loads(_text(v)))
                for k, v in self._redis.hgetall(self._key(owner)).items()}

    def delete(self, owner: str, name: str) -> bool:
        return bool(self._redis.hdel(self._key(owner), name))

    def delete_all(self, owner: str) -> None:
        self._redis.delete(self._key(owner))
