"""Tenant and Quota: the immutable values the store reads and writes."""
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
