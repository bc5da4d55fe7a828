"""Every Redis key name the tenants package uses, under one configurable prefix."""
from __future__ import annotations

from dataclasses import dataclass


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

    # Tenants: a hash per tenant plus a set of all names, so list() needs no SCAN.
    def tenants(self) -> str:
        return f"{self.prefix}tenants"

    def tenant(self, name: str) -> str:
        return f"{self.prefix}tenant:{name}"

    def tenant_keys(self, name: str) -> str:
        return f"{self.prefix}tenant:{name}:keys"

    # API keys: looked up by their public id; the record holds only a salted hash.
    def api_key(self, key_id: str) -> str:
        return f"{self.prefix}apikey:{key_id}"

    def api_key_prefix(self) -> str:
        return f"{self.prefix}apikey:"

    # Usage: one hash per tenant per UTC day.
    def usage(self, name: str, day: str) -> str:
        return f"{self.prefix}usage:{name}:{day}"

    # Limits: the sliding window log, its token charges and their running sum,
    # and the concurrency leases.
    def window(self, name: str) -> str:
        return f"{self.prefix}rl:{name}:win"

    def window_tokens(self, name: str) -> str:
        return f"{self.prefix}rl:{name}:tok"

    def window_token_sum(self, name: str) -> str:
        return f"{self.prefix}rl:{name}:toksum"

    def leases(self, name: str) -> str:
        return f"{self.prefix}rl:{name}:conc"

    def limit_keys(self, name: str) -> list[str]:
        return [self.window(name), self.window_tokens(name),
                self.window_token_sum(name), self.leases(name)]
