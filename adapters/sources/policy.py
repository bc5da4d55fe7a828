"""SourcePolicy: which adapter sources the operator allows, and their bounds."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

SOURCE_KINDS = ("s3", "https", "http", "local")


@dataclass(frozen=True)
class SourcePolicy:
    kinds: frozenset[str] = frozenset()           # allowed kinds, of SOURCE_KINDS; empty: uploads only
    local_root: Path | None = None                # `local` references must resolve under it
    s3_endpoint: str | None = None                # an S3-compatible endpoint URL (None: AWS)
    s3_region: str = "us-east-1"
    s3_buckets: frozenset[str] = frozenset()      # empty: any bucket at the endpoint
    http_hosts: frozenset[str] = frozenset()      # empty: any host whose address is public
    allow_private_networks: bool = False          # loopback, private, CGNAT addresses (link-local: never)
    max_file_bytes: int = 512 << 20               # each fetched file (or archive), checked before and while reading
    timeout_seconds: float = 30.0                 # a whole fetch, slow drips included
    max_redirects: int = 5

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(SOURCE_KINDS)
        if unknown:
            raise ValueError(f"unknown adapter source kind(s) {sorted(unknown)}: use {', '.join(SOURCE_KINDS)}")
        if "local" in self.kinds and self.local_root is None:
            raise ValueError("the local adapter source needs a root directory (--adapter-local-root)")
        if self.local_root is not None:
            object.__setattr__(self, "local_root", Path(self.local_root).expanduser().resolve())
        if self.max_file_bytes < 1:
            raise ValueError("max_file_bytes must be >= 1")
        if not self.timeout_seconds > 0:
            raise ValueError("timeout_seconds must be > 0")
        if self.max_redirects < 0:
            raise ValueError("max_redirects must be >= 0")
        object.__setattr__(self, "http_hosts", frozenset(h.lower() for h in self.http_hosts))

    def allows(self, kind: str) -> bool:
        return kind in self.kinds


def operator_policy(policy: SourcePolicy) -> SourcePolicy:
    """What the operator's own start-up references (--lora-modules) may use: any source kind and any
    local directory, with the same byte and time bounds and address checks."""
    return replace(policy, kinds=frozenset(SOURCE_KINDS), local_root=Path("/"))
