"""TenantStore: tenants, their quotas and API keys in Redis.

Layout (see Keyspace): a hash per tenant {quota: JSON, created_at, gen}, a set
of tenant names, a set of key ids per tenant, and a hash per API key
{tenant, gen, salt, digest, created_at}. `gen` is a random id minted when the
tenant is created: a key carries its tenant's gen, so a key of a deleted
tenant never authenticates a later tenant of the same name.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any

import redis

from tenants.errors import TenantExists, TenantNotFound
from tenants.keys import generate_key, parse_key, verify_secret
from tenants.keyspace import Keyspace, as_str
from tenants.models import Quota, Tenant, validate_tenant_name

# KEYS: tenant hash, names set. ARGV: name, quota json, created_at, gen.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'quota', ARGV[2], 'created_at', ARGV[3], 'gen', ARGV[4])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS: tenant hash, names set, key-id set, then the limiter's keys.
# ARGV: name, api key record prefix.
_DELETE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local ids = redis.call('SMEMBERS', KEYS[3])
for _, id in ipairs(ids) do redis.call('DEL', ARGV[2] .. id) end
redis.call('DEL', KEYS[3])
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""

# KEYS: tenant hash, key-id set, key record. ARGV: name, key id, salt, digest, created_at.
_CREATE_KEY = """
local gen = redis.call('HGET', KEYS[1], 'gen')
if not gen then return 0 end
redis.call('HSET', KEYS[3], 'tenant', ARGV[1], 'gen', gen, 'salt', ARGV[3],
           'digest', ARGV[4], 'created_at', ARGV[5])
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""

# KEYS: key-id set, key record. ARGV: key id.
_REVOKE_KEY = """
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('DEL', KEYS[2])
return 1
"""


class TenantStore:
    def __init__(self, client: redis.Redis, prefix: str = "lp:") -> None:
        self._r = client
        self._ks = Keyspace(prefix)
        self._create = client.register_script(_CREATE)
        self._delete = client.register_script(_DELETE)
        self._create_key = client.register_script(_CREATE_KEY)
        self._revoke_key = client.register_script(_REVOKE_KEY)

    # ---- tenants -------------------------------------------------------

    def create(self, name: str, quota: Quota | None = None) -> Tenant:
        tenant = self._try_create(name, quota)
        if tenant is None:
            raise TenantExists(f"tenant {name!r} already exists")
        return tenant

    def ensure(self, name: str, quota: Quota | None = None) -> Tenant:
        """Create the tenant if missing; an existing tenant keeps its quota."""
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
        tenant = Tenant(name=name, quota=quota, created_at=time.time())
        created = self._create(
            keys=[self._ks.tenant(name), self._ks.tenants()],
            args=[name, json.dumps(quota.to_dict()), repr(tenant.created_at), secrets.token_hex(8)])
        return tenant if int(created) == 1 else None

    def get(self, name: str) -> Tenant | None:
        if not isinstance(name, str) or not name:
            return None
        record = self._r.hgetall(self._ks.tenant(name))
        return self._decode(name, record)[0] if record else None

    def list(self) -> list[Tenant]:
        names = sorted(as_str(n) for n in self._r.smembers(self._ks.tenants()))
        pipe = self._r.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self._ks.tenant(name))
        out = []
        for name, record in zip(names, pipe.execute()):
            if record:  # deleted between the two reads
                out.append(self._decode(name, record)[0])
        return out

    def update_quota(self, name: str, patch: dict[str, Any]) -> Tenant:
        """Apply a PATCH to the tenant's quota, atomically against concurrent patches."""
        key = self._ks.tenant(name)

        def apply(pipe: redis.client.Pipeline) -> Tenant:
            record = pipe.hgetall(key)
            if not record:
                raise TenantNotFound(f"tenant {name!r} does not exist")
            tenant = self._decode(name, record)[0]
            quota = tenant.quota.merge(patch)  # raises QuotaError before any write
            pipe.multi()
            pipe.hset(key, "quota", json.dumps(quota.to_dict()))
            return Tenant(name=name, quota=quota, created_at=tenant.created_at)

        return self._r.transaction(apply, key, value_from_callable=True)

    def delete(self, name: str) -> bool:
        """Delete the tenant, revoke all its keys and drop its limiter state."""
        if not isinstance(name, str) or not name:
            return False
        keys = [self._ks.tenant(name), self._ks.tenants(), self._ks.tenant_keys(name),
                *self._ks.limit_keys(name)]
        return int(self._delete(keys=keys, args=[name, self._ks.api_key_prefix()])) == 1

    # ---- API keys ------------------------------------------------------

    def create_key(self, tenant_name: str) -> tuple[str, str]:
        """(key_id, key). The key is returned once; only its salted hash is stored."""
        new = generate_key()
        ok = self._create_key(
            keys=[self._ks.tenant(tenant_name), self._ks.tenant_keys(tenant_name),
                  self._ks.api_key(new.key_id)],
            args=[tenant_name, new.key_id, new.salt, new.digest, repr(time.time())])
        if int(ok) != 1:
            raise TenantNotFound(f"tenant {tenant_name!r} does not exist")
        return new.key_id, new.key

    def revoke_key(self, tenant_name: str, key_id: str) -> bool:
        if not isinstance(key_id, str) or not key_id:
            return False
        ok = self._revoke_key(
            keys=[self._ks.tenant_keys(tenant_name), self._ks.api_key(key_id)], args=[key_id])
        return int(ok) == 1

    def list_keys(self, tenant_name: str) -> list[dict[str, Any]]:
        """[{"id", "created_at"}] oldest first; never the key or its hash."""
        ids = sorted(as_str(i) for i in self._r.smembers(self._ks.tenant_keys(tenant_name)))
        pipe = self._r.pipeline(transaction=False)
        for key_id in ids:
            pipe.hget(self._ks.api_key(key_id), "created_at")
        out = [{"id": key_id, "created_at": float(as_str(created))}
               for key_id, created in zip(ids, pipe.execute()) if created is not None]
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
        tenant_record = self._r.hgetall(self._ks.tenant(name)) if name else None
        if not tenant_record:
            return None
        tenant, gen = self._decode(name, tenant_record)
        return tenant if gen == record.get("gen") else None

    # ---- helpers -------------------------------------------------------

    @staticmethod
    def _decode(name: str, record: dict) -> tuple[Tenant, str | None]:
        fields = {as_str(k): as_str(v) for k, v in record.items()}
        quota = Quota.from_dict(json.loads(fields["quota"]))
        tenant = Tenant(name=name, quota=quota, created_at=float(fields.get("created_at") or 0.0))
        return tenant, fields.get("gen")
