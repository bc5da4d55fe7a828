"""TenantStore: tenants, their quotas and API keys in Redis; and the API key format and hashing.

A key is `lp-<id>.<secret>`: the id is public and names the Redis record, the secret is stored
only as a salted HMAC-SHA256.

Layout (see Keyspace): a hash per tenant name {quota: JSON, created_at, gen},
a set of tenant names, and, keyed by the tenant's id, its set of key ids; a
hash per API key {tenant: name, gen: id, salt, digest, created_at}.

`gen` is the tenant's id: minted when the tenant is created and never
reused. It is stored as `gen` because versions before ids already minted it
(so a key of a deleted tenant never authenticates a later tenant of the same
name); existing tenants thereby keep their id with no re-keying.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis

from tenants import store_lua
from tenants.errors import TenantConcurrentChange, TenantExists, TenantNotFound
from tenants.migration import LegacyKeyMigration
from tenants.models import Keyspace, Quota, Tenant, as_str, new_tenant_id, validate_tenant_id, validate_tenant_name

KEY_PREFIX = "lp-"
_KEY_RE = re.compile(r"lp-([0-9a-f]{16})\.([A-Za-z0-9_-]{43})")
# A dummy record so a lookup that misses still pays for one HMAC and one compare,
# keeping the timing of "unknown id" close to "wrong secret".
_DUMMY_SALT = "00" * 16
_DUMMY_HASH = "00" * 32


@dataclass(frozen=True)
class NewKey:
    key_id: str
    key: str      # shown to the user once, never stored
    salt: str     # hex
    digest: str   # hex HMAC-SHA256(salt, secret)


def digest_secret(salt_hex: str, secret: str) -> str:
    return hmac.new(bytes.fromhex(salt_hex), secret.encode("utf-8"), hashlib.sha256).hexdigest()


def generate_key() -> NewKey:
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)  # 43 url-safe characters
    salt = secrets.token_hex(16)
    key = f"{KEY_PREFIX}{key_id}.{secret}"
    assert _KEY_RE.fullmatch(key), key
    return NewKey(key_id=key_id, key=key, salt=salt, digest=digest_secret(salt, secret))


def parse_key(key: object) -> tuple[str, str] | None:
    """(key_id, secret), or None for anything that is not a well-formed key."""
    if not isinstance(key, str) or len(key) > 128:
        return None
    m = _KEY_RE.fullmatch(key)
    if m is None:
        return None
    return m.group(1), m.group(2)


def verify_secret(secret: str, salt_hex: str | None, digest_hex: str | None) -> bool:
    """Constant-time check of `secret` against a stored record (None = no record)."""
    found = salt_hex is not None and digest_hex is not None
    try:
        actual = digest_secret(salt_hex if found else _DUMMY_SALT, secret)
    except ValueError:  # a corrupt salt in Redis authenticates nobody
        return False
    ok = hmac.compare_digest(actual, digest_hex if found else _DUMMY_HASH)
    return found and ok


# How often an operation re-reads a tenant that was deleted and recreated
# under the same name between its read and its atomic write.
_ATTEMPTS = 3
# A key's last use is written at most this often (seconds): one extra Redis write per key per
# minute, not per request.
LAST_USED_RESOLUTION = 60.0


class TenantStore:
    def __init__(self, client: redis.Redis, prefix: str = "lp:") -> None:
        self._r = client
        self._ks = Keyspace(prefix)
        self._create = client.register_script(store_lua.CREATE)
        self._delete = client.register_script(store_lua.DELETE)
        self._create_key = client.register_script(store_lua.CREATE_KEY)
        self._revoke_key = client.register_script(store_lua.REVOKE_KEY)
        self._touch_key = client.register_script(store_lua.TOUCH_KEY)
        self._migration = LegacyKeyMigration(client, self._ks)

    # ---- tenants -------------------------------------------------------

    def create(self, name: str, quota: Quota | None = None) -> Tenant:
        tenant = self._try_create(name, quota)
        if tenant is None:
            raise TenantExists(f"tenant {name!r} already exists")
        return tenant

    def ensure(self, name: str, quota: Quota | None = None) -> Tenant:
        """Create the tenant if missing; an existing tenant keeps its quota and id."""
        tenant = self._try_create(name, quota)
        if tenant is not None:
            return tenant
        existing = self.get(name)
        if existing is None:  # deleted between the two calls; try once more
            return self.create(name, quota)
        return existing

    def _try_create(self, name: str, quota: Quota | None) -> Tenant | None:
        validate_tenant_name(name)
        quota = quota if quota is not None else Quota()
        assert isinstance(quota, Quota)
        tenant = Tenant(name=name, id=new_tenant_id(), quota=quota, created_at=time.time())
        created = self._create(
            keys=[self._ks.tenant(name), self._ks.tenants()],
            args=[name, json.dumps(quota.to_dict()), repr(tenant.created_at), tenant.id])
        return tenant if int(created) == 1 else None

    def get(self, name: str) -> Tenant | None:
        if not isinstance(name, str) or not name:
            return None
        record = self._r.hgetall(self._ks.tenant(name))
        return self._decode(name, record) if record else None

    def list(self) -> list[Tenant]:
        names = sorted(as_str(n) for n in self._r.smembers(self._ks.tenants()))
        pipe = self._r.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self._ks.tenant(name))
        out = []
        for name, record in zip(names, pipe.execute()):
            if record:  # deleted between the two reads
                out.append(self._decode(name, record))
        return out

    def update_quota(self, name: str, patch: dict[str, Any]) -> Tenant:
        """Apply a PATCH to the tenant's quota, atomically against concurrent patches."""
        key = self._ks.tenant(name)

        def apply(pipe: redis.client.Pipeline) -> Tenant:
            record = pipe.hgetall(key)
            if not record:
                raise TenantNotFound(f"tenant {name!r} does not exist")
            tenant = self._decode(name, record)
            quota = tenant.quota.merge(patch)  # raises QuotaError before any write
            pipe.multi()
            pipe.hset(key, "quota", json.dumps(quota.to_dict()))
            return Tenant(name=name, id=tenant.id, quota=quota, created_at=tenant.created_at)

        return self._r.transaction(apply, key, value_from_callable=True)

    def delete(self, name: str) -> Tenant | None:
        """Delete the tenant and everything this package keeps for it (API keys,
        usage, limiter state) in one atomic step; None if there is no such tenant.

        Its id joins pending_purges() in that same step: the caller purges the
        tenant's adapters (kept by another package) and then calls purged(id),
        and a start-up pass finishes purges that a crash interrupted.
        """
        if not isinstance(name, str) or not name:
            return None
        for _ in range(_ATTEMPTS):
            tenant = self.get(name)
            if tenant is None:
                return None
            keys = [self._ks.tenant(name), self._ks.tenants(), self._ks.pending_purges(),
                    self._ks.tenant_keys(tenant.id), self._ks.usage_index(tenant.id),
                    *self._ks.limit_keys(tenant.id), self._ks.compile_seconds(tenant.id),
                    self._ks.source_credentials(tenant.id)]
            if int(self._delete(keys=keys, args=[name, tenant.id, self._ks.api_key_prefix()])) == 1:
                return tenant
        raise TenantConcurrentChange(f"tenant {name!r} kept being recreated during its deletion")

    def pending_purges(self) -> list[str]:
        """Ids of deleted tenants whose adapters may not have been purged yet."""
        return sorted(as_str(i) for i in self._r.smembers(self._ks.pending_purges()))

    def purged(self, tenant_id: str) -> None:
        """Record that the deleted tenant's adapters are purged."""
        self._r.srem(self._ks.pending_purges(), validate_tenant_id(tenant_id))

    def migrate_legacy_keys(self) -> int:
        """Move data that versions before tenant ids keyed by name to the id-keyed
        layout; idempotent, meant for every start. Returns how many legacy keys
        were moved (or deleted, for names whose tenant is gone)."""
        names = [as_str(n) for n in self._r.smembers(self._ks.tenants())]
        return self._migration.run(names, self.get)

    # ---- API keys ------------------------------------------------------

    def create_key(self, tenant_name: str) -> tuple[str, str]:
        """(key_id, key). The key is returned once; only its salted hash is stored."""
        new = generate_key()
        for _ in range(_ATTEMPTS):
            tenant = self.get(tenant_name)
            if tenant is None:
                raise TenantNotFound(f"tenant {tenant_name!r} does not exist")
            ok = self._create_key(
                keys=[self._ks.tenant(tenant_name), self._ks.tenant_keys(tenant.id),
                      self._ks.api_key(new.key_id)],
                args=[tenant_name, tenant.id, new.key_id, new.salt, new.digest, repr(time.time())])
            if int(ok) == 1:
                return new.key_id, new.key
        raise TenantConcurrentChange(f"tenant {tenant_name!r} kept being recreated")

    def revoke_key(self, tenant_name: str, key_id: str) -> bool:
        tenant = self.get(tenant_name)
        if tenant is None or not isinstance(key_id, str) or not key_id:
            return False
        ok = self._revoke_key(
            keys=[self._ks.tenant_keys(tenant.id), self._ks.api_key(key_id)], args=[key_id])
        return int(ok) == 1

    def list_keys(self, tenant_name: str) -> list[dict[str, Any]]:
        """[{"id", "created_at", "last_used_at"}] oldest first (last use to the minute, None if
        never used); never the key or its hash."""
        tenant = self.get(tenant_name)
        if tenant is None:
            return []
        ids = sorted(as_str(i) for i in self._r.smembers(self._ks.tenant_keys(tenant.id)))
        pipe = self._r.pipeline(transaction=False)
        for key_id in ids:
            pipe.hmget(self._ks.api_key(key_id), "created_at", "last_used")
        out = [{"id": key_id, "created_at": float(as_str(created)),
                "last_used_at": None if used is None else float(as_str(used))}
               for key_id, (created, used) in zip(ids, pipe.execute()) if created is not None]
        return sorted(out, key=lambda k: (k["created_at"], k["id"]))

    def authenticate(self, key: object) -> Tenant | None:
        """The tenant a key belongs to, or None (malformed, unknown, revoked, tenant gone)."""
        parsed = parse_key(key)
        if parsed is None:
            return None
        key_id, secret = parsed
        record = {as_str(k): as_str(v) for k, v in self._r.hgetall(self._ks.api_key(key_id)).items()}
        if not verify_secret(secret, record.get("salt"), record.get("digest")):
            return None
        name = record.get("tenant")
        tenant = self.get(name) if name else None
        # A key minted for an earlier tenant of this name carries that tenant's id.
        if tenant is None or tenant.id != record.get("gen"):
            return None
        now = time.time()
        if now - float(record.get("last_used") or 0.0) >= LAST_USED_RESOLUTION:
            self._touch_key(keys=[self._ks.api_key(key_id)], args=[repr(now)])
        return tenant

    # ---- helpers -------------------------------------------------------

    @staticmethod
    def _decode(name: str, record: dict) -> Tenant:
        fields = {as_str(k): as_str(v) for k, v in record.items()}
        quota = Quota.from_dict(json.loads(fields["quota"]))
        return Tenant(name=name, id=fields["gen"], quota=quota,
                      created_at=float(fields.get("created_at") or 0.0))
