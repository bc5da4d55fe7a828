"""Which tenants may use each operator adapter (--lora-modules): "all", or a list of tenant ids.
Kept in Redis, so the admin's choice survives restarts and holds for every replica."""
from __future__ import annotations

import json

ALL = "all"
# The registry owner of operator adapters: tenant ids are 16 hex digits, so it names no tenant.
OPERATOR_OWNER = "~operator"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


class SharingStore:
    def __init__(self, redis, prefix: str = "lp:") -> None:
        self._redis = redis
        self._key = f"{prefix}shared-adapters"

    def set(self, name: str, tenants: str | list[str]) -> None:
        assert tenants == ALL or isinstance(tenants, list), tenants
        self._redis.hset(self._key, name, json.dumps(tenants))

    def set_default(self, name: str, tenants: str | list[str]) -> None:
        """Only where the admin has not chosen yet: a restart keeps the admin's choice."""
        self._redis.hsetnx(self._key, name, json.dumps(tenants))

    def get(self, name: str) -> str | list[str] | None:
        raw = self._redis.hget(self._key, name)
        return None if raw is None else json.loads(_text(raw))

    def all(self) -> dict[str, str | list[str]]:
        return {_text(k): json.loads(_text(v)) for k, v in self._redis.hgetall(self._key).items()}

    def visible(self, name: str, tenant_id: str) -> bool:
        tenants = self.get(name)
        return tenants == ALL or (isinstance(tenants, list) and tenant_id in tenants)

    def visible_names(self, tenant_id: str) -> list[str]:
        return sorted(n for n, t in self.all().items() if t == ALL or (isinstance(t, list) and tenant_id in t))

    def delete(self, name: str) -> None:
        self._redis.hdel(self._key, name)
