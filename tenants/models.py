"""What the tenants package stores, and where: Tenant and Quota, the immutable values the store reads
and writes; and Keyspace, every Redis key name the tenants package uses, under one configurable
prefix.

The tenant hash is found by name (that is how admins and API keys address a
tenant). Everything a tenant owns is keyed by its immutable id under
`t:{id}:`, so a later tenant that reuses the name can never see it. Names
match [a-z0-9][a-z0-9_-]{0,62} and ids are 16 hex digits, so the two can
coincide: the distinct `t:` segment keeps id-keyed names apart from the
name-keyed ones that versions before ids wrote (the `legacy_*` names, kept
only so migrate_legacy_keys can find them).
"""
from __future__ import annotations

import math
import re
import secrets
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from tenants.errors import QuotaError, TenantIdError, TenantNameError

TENANT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
# Ids are what the store has always minted as a tenant's `gen`, so tenants
# created before ids existed keep theirs.
TENANT_ID_RE = re.compile(r"[0-9a-f]{16}")

# Fields that are a non-negative int or None (None = unlimited).
_LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "max_adapters",
    "max_adapter_bytes",
    "max_lora_rank",
    "max_tokens_per_request",
)


def _check_limit(name: str, value: Any) -> None:
    # bool is an int subclass; `true` as a limit is a client bug, not 1.
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise QuotaError(name, f"must be a non-negative integer or null, got {type(value).__name__}")
    if value < 0:
        raise QuotaError(name, f"must be >= 0, got {value}")


def _check_weight(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise QuotaError("weight", f"must be a positive number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise QuotaError("weight", f"must be a finite number > 0, got {value}")


@dataclass(frozen=True)
class Quota:
    """Per-tenant limits; None means unlimited. `weight` is the fair-share weight."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_adapters: int | None = None
    max_adapter_bytes: int | None = None   # per adapter upload
    max_lora_rank: int | None = None
    max_tokens_per_request: int | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        for name in _LIMIT_FIELDS:
            _check_limit(name, getattr(self, name))
        _check_weight(self.weight)
        object.__setattr__(self, "weight", float(self.weight))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, d: Any) -> "Quota":
        """Build from a JSON object; missing fields take their defaults (unlimited, weight 1)."""
        if d is None:
            return cls()
        return cls().merge(d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def merge(self, patch: Any) -> "Quota":
        """A copy with the fields in `patch` replaced (PATCH semantics; null = unlimited)."""
        if not isinstance(patch, dict):
            raise QuotaError("quota", f"must be a JSON object, got {type(patch).__name__}")
        known = self.field_names()
        for key, value in patch.items():
            if key not in known:
                raise QuotaError(str(key), f"unknown field; known fields: {', '.join(known)}")
            if key == "weight":
                _check_weight(value)
            else:
                _check_limit(key, value)
        return replace(self, **patch)


def validate_tenant_name(name: Any) -> str:
    if not isinstance(name, str) or not TENANT_NAME_RE.fullmatch(name):
        raise TenantNameError(
            f"invalid tenant name {name!r}: use 1-63 characters from a-z, 0-9, '_' and '-', "
            "starting with a letter or digit")
    return name


def new_tenant_id() -> str:
    return secrets.token_hex(8)


def validate_tenant_id(tenant_id: Any) -> str:
    if not isinstance(tenant_id, str) or not TENANT_ID_RE.fullmatch(tenant_id):
        raise TenantIdError(f"invalid tenant id {tenant_id!r}: expected 16 lowercase hex digits")
    return tenant_id


@dataclass(frozen=True)
class Tenant:
    """A tenant. `name` is a label that a later tenant may reuse once this one is
    deleted; `id` is minted at creation and never reused, so everything the
    tenant owns is keyed by it."""

    name: str
    id: str
    quota: Quota = field(default_factory=Quota)
    created_at: float = 0.0  # unix seconds

    def __post_init__(self) -> None:
        validate_tenant_name(self.name)
        validate_tenant_id(self.id)
        assert isinstance(self.quota, Quota)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "quota": self.quota.to_dict(),
                "created_at": self.created_at}


_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def as_str(value: bytes | str | None) -> str | None:
    """Redis replies are bytes unless the client decodes; accept both."""
    if value is None or isinstance(value, str):
        return value
    return value.decode("utf-8")


@dataclass(frozen=True)
class Keyspace:
    prefix: str = "lp:"

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str):
            raise TypeError(f"prefix must be a str, got {type(self.prefix).__name__}")
        if any(c.isspace() for c in self.prefix):
            raise ValueError(f"prefix must not contain whitespace: {self.prefix!r}")

    # Tenants: a hash per tenant (by name) plus a set of all names, so list()
    # needs no SCAN, and the ids of deleted tenants whose adapters still need purging.
    def tenants(self) -> str:
        return f"{self.prefix}tenants"

    def tenant(self, name: str) -> str:
        return f"{self.prefix}tenant:{name}"

    def pending_purges(self) -> str:
        return f"{self.prefix}tenants:purge"

    def owned(self, tenant_id: str) -> str:
        """The common start of every key a tenant owns."""
        return f"{self.prefix}t:{tenant_id}:"

    def tenant_keys(self, tenant_id: str) -> str:
        return f"{self.owned(tenant_id)}keys"

    # API keys: looked up by their public id; the record holds only a salted hash.
    def api_key(self, key_id: str) -> str:
        return f"{self.prefix}apikey:{key_id}"

    def api_key_prefix(self) -> str:
        return f"{self.prefix}apikey:"

    # Failed authentications in the current window (tenants.limits): per client address
    # (or IPv6 /64) and per key id.
    def auth_failures_by_address(self, bucket: str) -> str:
        return f"{self.prefix}authfail:addr:{bucket}"

    def auth_failures_by_key(self, key_id: str) -> str:
        return f"{self.prefix}authfail:key:{key_id}"

    # Usage: one hash per tenant per UTC day, plus an index of those hashes
    # (ZSET key name -> expiry time) so deleting the tenant finds every one
    # (the refusal hashes below join the same index).
    def usage(self, tenant_id: str, day: str) -> str:
        return f"{self.owned(tenant_id)}usage:{day}"

    def usage_index(self, tenant_id: str) -> str:
        return f"{self.owned(tenant_id)}usage"

    # What was recorded so far of one running request (tenants.limits.record_so_far), by its id.
    def running_usage(self, tenant_id: str, run: str) -> str:
        return f"{self.owned(tenant_id)}running:{run}"

    # Refusals (tenants.refusals): one hash per tenant per UTC day, in the usage index too.
    def refusals(self, tenant_id: str, day: str) -> str:
        return f"{self.owned(tenant_id)}refusals:{day}"

    # Limits: the sliding window log, its token charges and their running sum,
    # and the concurrency leases.
    def window(self, tenant_id: str) -> str:
        return f"{self.owned(tenant_id)}rl:win"

    def window_tokens(self, tenant_id: str) -> str:
        return f"{self.owned(tenant_id)}rl:tok"

    def window_token_sum(self, tenant_id: str) -> str:
        return f"{self.owned(tenant_id)}rl:toksum"

    def leases(self, tenant_id: str) -> str:
        return f"{self.owned(tenant_id)}rl:conc"

    def compile_seconds(self, tenant_id: str) -> str:
        return f"{self.owned(tenant_id)}rl:compile"

    # Adapter-source credentials (tenants.source_credentials): one hash, sealed values per kind.
    def source_credentials(self, tenant_id: str) -> str:
        return f"{self.owned(tenant_id)}srccred"

    def limit_keys(self, tenant_id: str) -> list[str]:
        return [self.window(tenant_id), self.window_tokens(tenant_id),
                self.window_token_sum(tenant_id), self.leases(tenant_id)]

    # Name-keyed layout of versions before tenant ids, in the same order as
    # the id-keyed names above.
    def legacy_tenant_keys(self, name: str) -> str:
        return f"{self.prefix}tenant:{name}:keys"

    def legacy_limit_keys(self, name: str) -> list[str]:
        return [f"{self.prefix}rl:{name}:{part}" for part in ("win", "tok", "toksum", "conc")]

    def legacy_usage_prefix(self) -> str:
        """Legacy usage hashes are `{this}{name}:{day}`."""
        return f"{self.prefix}usage:"

    def legacy_usage_pattern(self) -> str:
        """A SCAN pattern matching every legacy usage hash (and nothing id-keyed)."""
        return _GLOB_SPECIAL.sub(r"\\\1", self.legacy_usage_prefix()) + "*"
