"""Every Redis key name the tenants package uses, under one configurable prefix.

The tenant hash is found by name (that is how admins and API keys address a
tenant). Everything a tenant owns is keyed by its immutable id under
`t:{id}:`, so a later tenant that reuses the name can never see it. Names
match [a-z0-9][a-z0-9_-]{0,62} and ids are 16 hex digits, so the two can
coincide: the distinct `t:` segment keeps id-keyed names apart from the
name-keyed ones that versions before ids wrote (the `legacy_*` names, kept
only so migrate_legacy_keys can find them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

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

    # Failed authentications in the current window (tenants.auth_throttle): per client address
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

    # What was recorded so far of one running request (tenants.usage.record_so_far), by its id.
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
