"""How the adapter registry lays its data out in Redis: key names, version
records, and content-addressed chunk storage for adapter files.

Layout (prefix ``P``, default ``lp:``):
  P ad:idx:t:{tenant id}  hash    name -> current version id (listing, count, quota)
  P ad:gone:{tenant id}   string  with a TTL: the tenant's adapters were purged
  P ad:ver:{version}      hash    the immutable version record (+ retired_at once retired)
  P ad:chunk:{sha256}     hash    {data, refs}: content-addressed file chunks
  P ad:stage:{up}:{sha}   hash    {data, refs=0}: an upload's chunks before commit, with a TTL
  P ad:retired            zset    version -> time it was replaced or deleted
  P ad:dora:{version}     hash    base identity -> a DoRA version's scales against it (adapters.dora_scale_store)
  P ad:idx:{tenant name}  hash    an index from before tenant ids, until migrated
  P adapter-events        pub/sub channel: {"event", "tenant" (the id), "name", "version"}

A file is cut into fixed-size chunks; each chunk lives once under the sha256
of its bytes, as a hash ``{data, refs}``, so identical uploads (or identical
regions of different uploads) share storage. Uploads first write their chunks
to *staging* keys that carry a TTL; the registry's commit script then turns
them into permanent chunk keys atomically. A process that dies between the
two leaves only staging keys, and those expire on their own.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

# How many chunk writes go into one pipeline round trip: bounds the client-side
# buffer for big uploads while keeping round trips few.
_STAGE_BATCH = 8
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


@dataclass(frozen=True)
class RegistryKeys:
    """Every Redis key the registry touches, so the layout is in one place."""

    prefix: str

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str):
            raise TypeError("prefix must be a str")

    def index(self, tenant_id: str) -> str:
        # The id is the only free-form part of the key, so any id maps to a
        # distinct key. The `t:` segment keeps these apart from the indexes
        # that versions before tenant ids kept by tenant name (names have no ':').
        return f"{self.prefix}ad:idx:t:{tenant_id}"

    def references(self, tenant_id: str) -> str:
        """The tenant's adapters by reference (adapters.references): counted with the index
        toward max_adapters, in the same Lua scripts."""
        return f"{self.prefix}adapter-refs:{tenant_id}"

    def legacy_index(self, tenant_name: str) -> str:
        return f"{self.prefix}ad:idx:{tenant_name}"

    @property
    def index_prefix(self) -> str:
        return f"{self.prefix}ad:idx:"

    @property
    def index_pattern(self) -> str:
        """A SCAN pattern for every index, legacy or id-keyed."""
        return _GLOB_SPECIAL.sub(r"\\\1", self.index_prefix) + "*"

    def tombstone(self, tenant_id: str) -> str:
        """Set when a tenant's adapters are purged, so an upload that was in
        flight then cannot commit into the dead tenant afterwards."""
        return f"{self.prefix}ad:gone:{tenant_id}"

    @property
    def version_prefix(self) -> str:
        return f"{self.prefix}ad:ver:"

    def version(self, version: str) -> str:
        return self.version_prefix + version

    @property
    def dora_scales_prefix(self) -> str:
        return f"{self.prefix}ad:dora:"

    def dora_scales(self, version: str) -> str:
        """A DoRA version's precomputed scales, one field per base identity; collected with the version."""
        return self.dora_scales_prefix + version

    @property
    def chunk_prefix(self) -> str:
        return f"{self.prefix}ad:chunk:"

    def chunk(self, digest: str) -> str:
        return self.chunk_prefix + digest

    def stage_prefix(self, upload_id: str) -> str:
        return f"{self.prefix}ad:stage:{upload_id}:"

    @property
    def retired(self) -> str:
        return f"{self.prefix}ad:retired"

    @property
    def events(self) -> str:
        return f"{self.prefix}adapter-events"


@dataclass(frozen=True)
class ChunkedFile:
    """How one stored file is put back together and checked."""

    sha256: str
    length: int
    digests: tuple[str, ...]

    def __post_init__(self) -> None:
        assert self.length >= 0
        assert (self.length == 0) == (len(self.digests) == 0)


@dataclass(frozen=True)
class AdapterRecord:
    """A stored adapter version. `tenant` is the owning tenant's id."""

    tenant: str
    name: str
    version: str
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int
    created_at: float
    # The base model it was validated against ("NAME@FINGERPRINT", server.api.base_identity); "" for a
    # version stored before bases were recorded.
    base: str = ""

    def public(self) -> dict:
        return {"id": self.version, "name": self.name, "version": self.version,
                "rank": self.rank, "target_modules": list(self.target_modules),
                "size_bytes": self.size_bytes, "created_at": self.created_at, "base": self.base or None}


# A version's optional parts' files, by field prefix (their chunks are collected with the version's): its
# own Medusa heads (adapters.medusa_format) and its draft LoRA (adapters.draft_lora).
MEDUSA_PARTS = ("medusa_config", "medusa_weights")
DRAFT_PARTS = ("draft_config", "draft_weights")
OPTIONAL_PARTS = {"medusa": MEDUSA_PARTS, "draft": DRAFT_PARTS}


@dataclass(frozen=True)
class StoredVersion:
    """A version record as stored: the public record, its files' layout, and
    when it was retired (None while current)."""

    record: AdapterRecord
    config: ChunkedFile
    weights: ChunkedFile
    retired_at: float | None
    # The adapter's own Medusa heads (adapters.medusa_format): their config's and weights' layouts, or None.
    medusa: tuple[ChunkedFile, ChunkedFile] | None = None
    # Its draft LoRA (adapters.draft_lora): its config's and weights' layouts, or None.
    draft: tuple[ChunkedFile, ChunkedFile] | None = None

    def part(self, name: str) -> tuple[ChunkedFile, ChunkedFile] | None:
        """An optional part's layouts by its OPTIONAL_PARTS name."""
        return {"medusa": self.medusa, "draft": self.draft}[name]

    def fields(self) -> dict[str, str]:
        """The Redis hash of the record (without retired_at, which only scripts set)."""
        r, config, weights = self.record, self.config, self.weights
        heads = {}
        for name, prefixes in OPTIONAL_PARTS.items():
            for part, layout in zip(prefixes, self.part(name) or ()):
                heads |= {f"{part}_sha256": layout.sha256, f"{part}_len": str(layout.length),
                          f"{part}_chunks": json.dumps(list(layout.digests))}
        return heads | {"tenant": r.tenant, "name": r.name, "version": r.version,
                "rank": str(r.rank), "target_modules": json.dumps(list(r.target_modules)),
                "size_bytes": str(r.size_bytes), "created_at": repr(r.created_at), "base": r.base,
                "config_sha256": config.sha256, "config_len": str(config.length),
                "config_chunks": json.dumps(list(config.digests)),
                "weights_sha256": weights.sha256, "weights_len": str(weights.length),
                "weights_chunks": json.dumps(list(weights.digests))}

    @classmethod
    def parse(cls, fields: dict) -> "StoredVersion":
        f = {_text(k): _text(v) for k, v in fields.items()}
        record = AdapterRecord(
            tenant=f["tenant"], name=f["name"], version=f["version"], rank=int(f["rank"]),
            target_modules=tuple(json.loads(f["target_modules"])),
            size_bytes=int(f["size_bytes"]), created_at=float(f["created_at"]), base=f.get("base", ""))
        config = ChunkedFile(f["config_sha256"], int(f["config_len"]),
                             tuple(json.loads(f["config_chunks"])))
        weights = ChunkedFile(f["weights_sha256"], int(f["weights_len"]),
                              tuple(json.loads(f["weights_chunks"])))
        retired = f.get("retired_at")
        parts = {}
        for name, prefixes in OPTIONAL_PARTS.items():
            if f"{prefixes[0]}_sha256" in f:
                parts[name] = tuple(ChunkedFile(f[f"{p}_sha256"], int(f[f"{p}_len"]),
                                                tuple(json.loads(f[f"{p}_chunks"]))) for p in prefixes)
        return cls(record, config, weights, None if retired is None else float(retired), **parts)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def split(data: bytes, chunk_size: int) -> tuple[ChunkedFile, dict[str, bytes]]:
    """Cut ``data`` into chunks; returns the file's layout and its distinct chunks."""
    assert chunk_size > 0
    view = memoryview(data)
    digests: list[str] = []
    payloads: dict[str, bytes] = {}
    for start in range(0, len(view), chunk_size):
        piece = bytes(view[start:start + chunk_size])
        digest = hashlib.sha256(piece).hexdigest()
        digests.append(digest)
        payloads.setdefault(digest, piece)
    layout = ChunkedFile(hashlib.sha256(view).hexdigest(), len(view), tuple(digests))
    return layout, payloads


class ChunkStore:
    """Stages, discards and reads chunks; never changes reference counts
    (only the registry's atomic scripts do that)."""

    def __init__(self, redis, keys: RegistryKeys, pending_ttl_ms: int) -> None:
        assert pending_ttl_ms > 0
        self._redis = redis
        self._keys = keys
        self._pending_ttl_ms = pending_ttl_ms

    def existing(self, digests: list[str]) -> set[str]:
        """The digests that already have a permanent chunk (a hint only: a
        chunk can be collected right after; the commit re-checks)."""
        if not digests:
            return set()
        pipe = self._redis.pipeline(transaction=False)
        for digest in digests:
            pipe.exists(self._keys.chunk(digest))
        return {d for d, n in zip(digests, pipe.execute()) if n}

    def stage(self, upload_id: str, payloads: dict[str, bytes]) -> None:
        """Write chunks under this upload's staging keys, each with a TTL so a
        crashed upload cleans itself up."""
        prefix = self._keys.stage_prefix(upload_id)
        items = list(payloads.items())
        for start in range(0, len(items), _STAGE_BATCH):
            # MULTI/EXEC: the TTL goes on with the write, so no staged chunk
            # ever exists without an expiry, even if this process dies here.
            pipe = self._redis.pipeline(transaction=True)
            for digest, data in items[start:start + _STAGE_BATCH]:
                key = prefix + digest
                pipe.hset(key, mapping={"data": data, "refs": 0})
                pipe.pexpire(key, self._pending_ttl_ms)
            pipe.execute()

    def discard(self, upload_id: str, digests: set[str]) -> None:
        """Delete staged chunks of an upload that will not be committed."""
        if digests:
            prefix = self._keys.stage_prefix(upload_id)
            self._redis.delete(*[prefix + d for d in digests])

    def read(self, layout: ChunkedFile) -> bytes | None:
        """Reassemble a file; None if any chunk is gone (collected)."""
        if layout.length == 0:
            return b""
        pipe = self._redis.pipeline(transaction=False)
        for digest in layout.digests:
            pipe.hget(self._keys.chunk(digest), "data")
        pieces = pipe.execute()
        if any(p is None for p in pieces):
            return None
        return b"".join(pieces)
