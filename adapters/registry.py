"""The Redis adapter registry: who owns which adapter, and the adapter files.

A tenant is named by its immutable id, never by its name, so a later tenant
reusing the name starts empty; adapters.chunks has the Redis layout.

``put`` is all-or-nothing; adapters.registry_scripts lists how each of its
failure points is covered. Replaced/deleted versions stay readable for ``grace_seconds`` (running
requests keep working) and are released by ``collect_garbage``, which every
put/delete runs first. ``delete_all`` retires a deleted tenant's versions the
same way and leaves a tombstone that makes a commit still in flight for that
tenant fail rather than recreate its index. The scripts derive some key
names at run time, which assumes a single Redis instance (not Redis Cluster).
"""
from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections import Counter
from typing import Callable

from adapters.chunks import AdapterRecord, ChunkStore, RegistryKeys, StoredVersion, split
from adapters.registry_scripts import (_CLAIM_BASE_LUA, _COLLECT_LUA, _COMMIT_LUA, _DELETE_LUA,
                                       _MIGRATE_INDEX_LUA, _RETIRE_ALL_LUA)

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_VERSION_RE = re.compile(r"[0-9a-f]{32}")
_COMMIT_ATTEMPTS = 4
_GC_BATCH = 64
# Far longer than any upload takes, so a put that was in flight when its
# tenant was purged still finds the tombstone at its commit.
_TOMBSTONE_SECONDS = 7 * 86400

__all__ = ["AdapterCorrupted", "AdapterExists", "AdapterNotFound", "AdapterQuotaExceeded",
           "AdapterRecord", "AdapterRegistry", "TenantAdaptersPurged", "validate_name"]


class AdapterExists(Exception):
    """The tenant already has an adapter of that name (and replace was not asked)."""


class AdapterNotFound(Exception):
    """No such adapter or version (or it was retired and its grace has passed)."""


class TenantAdaptersPurged(AdapterNotFound):
    """The tenant was deleted (its adapters purged) while this upload ran."""


class AdapterCorrupted(Exception):
    """Stored bytes no longer match the checksum recorded at upload."""


class AdapterQuotaExceeded(Exception):
    def __init__(self, limit_name: str, limit: int, message: str) -> None:
        super().__init__(message)
        self.limit_name = limit_name
        self.limit = limit


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid adapter name {name!r}: use 1-64 characters from "
                         "A-Z a-z 0-9 . _ -, starting with a letter or digit")
    return name


def name_or_none(name: str) -> str | None:
    """`name`, or None when no adapter can have it (a lookup by it finds nothing: a 404, not a 400)."""
    try:
        return validate_name(name)
    except ValueError:
        return None


def _validate_tenant_id(tenant_id: str) -> str:
    if not isinstance(tenant_id, str) or not tenant_id or len(tenant_id) > 128 \
            or not tenant_id.isprintable():
        raise ValueError(f"invalid tenant id {tenant_id!r}: need 1-128 printable characters")
    return tenant_id


def _validate_legacy_name(tenant_name: str) -> str:
    # A ':' would make the legacy index name read as an id-keyed one.
    if ":" in _validate_tenant_id(tenant_name):
        raise ValueError(f"invalid tenant name {tenant_name!r}: contains ':'")
    return tenant_name


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


class AdapterRegistry:
    def __init__(self, redis, prefix: str = "lp:", chunk_size: int = 1 << 20,
                 grace_seconds: float = 600, *, pending_ttl_seconds: float = 3600,
                 clock: Callable[[], float] = time.time) -> None:
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        if grace_seconds < 0:
            raise ValueError("grace_seconds must be >= 0")
        if pending_ttl_seconds <= 0:
            raise ValueError("pending_ttl_seconds must be positive")
        if redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("the registry stores binary chunks: use a Redis client "
                             "with decode_responses=False")
        self._redis = redis
        self._keys = RegistryKeys(prefix)
        self._chunks = ChunkStore(redis, self._keys, max(1, int(pending_ttl_seconds * 1000)))
        self._chunk_size = chunk_size
        self._grace = float(grace_seconds)
        self._clock = clock
        self._commit = redis.register_script(_COMMIT_LUA)
        self._delete = redis.register_script(_DELETE_LUA)
        self._retire_all = redis.register_script(_RETIRE_ALL_LUA)
        self._migrate_index = redis.register_script(_MIGRATE_INDEX_LUA)
        self._collect = redis.register_script(_COLLECT_LUA)
        self._claim_base = redis.register_script(_CLAIM_BASE_LUA)

    @property
    def events_channel(self) -> str:
        return self._keys.events

    # ---- writes -------------------------------------------------------

    def put(self, tenant_id: str, name: str, config_json: bytes, weights: bytes, *, summary,
            replace: bool = False, max_adapters: int | None = None, base: str = "",
            medusa: tuple[bytes, bytes] | None = None, draft: tuple[bytes, bytes] | None = None) -> AdapterRecord:
        """Store a validated adapter; all-or-nothing (see the module docstring). `base`: the base
        model it was validated against (kept in its record); `medusa`: its own Medusa heads' config and
        weights files, validated too (adapters.medusa_format), stored with it; `draft`: its draft LoRA's
        (adapters.draft_lora), alike.
        Raises TenantAdaptersPurged if the tenant's adapters were purged meanwhile."""
        _validate_tenant_id(tenant_id)
        validate_name(name)
        if max_adapters is not None and max_adapters < 0:
            raise ValueError("max_adapters must be >= 0")
        now = self._clock()
        self.collect_garbage(now)
        index = self._keys.index(tenant_id)
        # Cheap early refusals so a doomed upload sends no chunks; the commit re-checks.
        exists = self._redis.hexists(index, name)
        if exists and not replace:
            raise AdapterExists(f"adapter {name!r} already exists")
        if not exists and max_adapters is not None and self._redis.hlen(index) >= max_adapters:
            raise self._quota_error(max_adapters)

        config_layout, config_chunks = split(config_json, self._chunk_size)
        weights_layout, weights_chunks = split(weights, self._chunk_size)
        payloads = {**config_chunks, **weights_chunks}
        digests = config_layout.digests + weights_layout.digests
        parts = {}  # optional part -> its two files' layouts
        for part, files in (("medusa", medusa), ("draft", draft)):
            if files is not None:
                split_files = [split(data, self._chunk_size) for data in files]
                for layout, chunks in split_files:
                    payloads |= chunks
                    digests += layout.digests
                parts[part] = tuple(layout for layout, _ in split_files)
        counts = Counter(digests)
        record = AdapterRecord(tenant_id, name, uuid.uuid4().hex, int(summary.rank),
                               tuple(summary.target_modules), int(summary.size_bytes), now, base)
        fields = StoredVersion(record, config_layout, weights_layout, None, **parts).fields()
        upload_id = uuid.uuid4().hex
        staged: set[str] = set()
        try:
            to_stage = set(payloads) - self._chunks.existing(list(payloads))
            for _ in range(_COMMIT_ATTEMPTS):
                # Recorded before writing: a half-done stage must be discarded too.
                # A retry restages whatever the commit found missing, including
                # staged chunks whose TTL ran out during a slow upload.
                staged |= to_stage
                self._stage(upload_id, {d: payloads[d] for d in to_stage})
                reply = self._run_commit(record, upload_id, replace, max_adapters, fields, counts)
                status = _text(reply[0])
                if status == "ok":
                    return record
                if status == "exists":
                    raise AdapterExists(f"adapter {name!r} already exists")
                if status == "quota":
                    raise self._quota_error(max_adapters)
                if status == "gone":
                    raise TenantAdaptersPurged("the tenant was deleted during the upload")
                assert status == "missing", status
                # Chunks we counted on were collected meanwhile; send them too.
                to_stage = {_text(d) for d in reply[1:]}
            raise RuntimeError(f"upload of {name!r} kept losing chunks to garbage collection")
        finally:
            # After a commit the staged keys are already gone (moved or deleted);
            # after any failure they must not outlive the upload.
            self._discard(upload_id, staged)

    def delete(self, tenant_id: str, name: str) -> AdapterRecord | None:
        """Remove the name now; its version stays readable for the grace period."""
        _validate_tenant_id(tenant_id)
        validate_name(name)
        now = self._clock()
        self.collect_garbage(now)
        reply = self._delete(keys=[self._keys.index(tenant_id), self._keys.retired],
                             args=[repr(now), name, self._keys.version_prefix,
                                   self._keys.events, tenant_id])
        if not reply:
            return None
        return StoredVersion.parse(dict(zip(reply[0::2], reply[1::2]))).record

    def delete_all(self, tenant_id: str) -> list[AdapterRecord]:
        """Retire every adapter of a deleted tenant, as delete() retires one, in
        one atomic step; idempotent. Storage is freed by garbage collection
        once the grace period has passed. Returns the retired records by name."""
        _validate_tenant_id(tenant_id)
        return self._retire_index(self._keys.index(tenant_id), tenant_id,
                                  self._keys.tombstone(tenant_id), _TOMBSTONE_SECONDS)

    def migrate_legacy_index(self, tenant_name: str, tenant_id: str) -> int:
        """Move the index that versions before tenant ids kept under the tenant's
        name to its id, and make its versions' records name the id; idempotent.
        Returns how many adapters moved."""
        _validate_legacy_name(tenant_name)
        _validate_tenant_id(tenant_id)
        return int(self._migrate_index(
            keys=[self._keys.legacy_index(tenant_name), self._keys.index(tenant_id),
                  self._keys.retired],
            args=[repr(self._clock()), self._keys.version_prefix, self._keys.events, tenant_id]))

    def legacy_index_names(self) -> list[str]:
        """Tenant names that still have a legacy (name-keyed) index."""
        start = len(self._keys.index_prefix)
        found = (_text(k)[start:] for k in self._redis.scan_iter(
            match=self._keys.index_pattern, count=1000))
        return sorted(n for n in found if ":" not in n)

    def purge_legacy_index(self, tenant_name: str) -> list[AdapterRecord]:
        """Retire every adapter in the legacy index of a name that has no tenant
        any more (deleted before tenant ids existed), so its storage is freed."""
        _validate_legacy_name(tenant_name)
        return self._retire_index(self._keys.legacy_index(tenant_name), tenant_name,
                                  self._keys.tombstone(tenant_name), 0)

    def collect_garbage(self, now: float | None = None) -> int:
        """Release versions retired more than grace_seconds ago; returns how many."""
        now = self._clock() if now is None else now
        cutoff = repr(now - self._grace)
        released = 0
        while True:
            n = int(self._collect(keys=[self._keys.retired],
                                  args=[cutoff, _GC_BATCH, self._keys.version_prefix,
                                        self._keys.chunk_prefix, self._keys.dora_scales_prefix]))
            released += n
            if n < _GC_BATCH:
                return released

    def claim_base(self, version: str, base: str) -> bool:
        """Record `base` on a version stored without one (validated against it since); False if the
        version is gone or has its base already."""
        if not _VERSION_RE.fullmatch(version) or not base:
            raise ValueError("claim_base needs a version id and a base")
        return bool(self._claim_base(keys=[self._keys.version(version)], args=[base]))

    # ---- reads --------------------------------------------------------

    def get(self, tenant_id: str, name: str) -> AdapterRecord | None:
        _validate_tenant_id(tenant_id)
        validate_name(name)
        version = self._redis.hget(self._keys.index(tenant_id), name)
        if version is None:
            return None
        stored = self._load(_text(version))
        return None if stored is None else stored.record

    def get_version(self, version: str, tenant_id: str | None = None) -> AdapterRecord | None:
        """The record of a version id, current or within its grace period.
        Pass ``tenant_id`` to get None for another tenant's version."""
        stored = self._load(version)
        if stored is None or (tenant_id is not None and stored.record.tenant != tenant_id):
            return None
        return stored.record

    def retired_versions(self, versions: set[str]) -> set[str]:
        """Those of `versions` that were deleted or replaced (or are gone altogether): what a
        process that missed the registry's events must drop from its tiers."""
        ordered = sorted(versions)
        pipe = self._redis.pipeline(transaction=False)
        for v in ordered:
            pipe.hmget(self._keys.version(v), "version", "retired_at")
        return {v for v, (current, retired) in zip(ordered, pipe.execute()) if current is None or retired}

    def list(self, tenant_id: str) -> list[AdapterRecord]:
        _validate_tenant_id(tenant_id)
        versions = [_text(v) for v in self._redis.hvals(self._keys.index(tenant_id))]
        pipe = self._redis.pipeline(transaction=False)
        for v in versions:
            pipe.hgetall(self._keys.version(v))
        # A record can vanish between the two reads (deleted and collected): skip it.
        records = [StoredVersion.parse(f).record for f in pipe.execute() if f]
        return sorted(records, key=lambda r: r.name)

    def count(self, tenant_id: str) -> int:
        _validate_tenant_id(tenant_id)
        return int(self._redis.hlen(self._keys.index(tenant_id)))

    def read_files(self, version: str) -> tuple[bytes, bytes]:
        """(adapter_config.json, adapter_model.safetensors) of a version, checked
        against the upload's sha256."""
        stored = self._load(version)
        if stored is None:
            raise AdapterNotFound(f"adapter version {version!r} not found")
        config_json, weights = self._read(version, (stored.config, stored.weights))
        return config_json, weights

    def read_medusa(self, version: str) -> tuple[bytes, bytes] | None:
        """A version's own Medusa heads (medusa_config.json, medusa_heads.safetensors), checked against the
        upload's sha256; None when it was stored without."""
        return self._read_part(version, "medusa")

    def read_draft(self, version: str) -> tuple[bytes, bytes] | None:
        """A version's draft LoRA (adapter_config.json, adapter_model.safetensors for the draft model),
        checked against the upload's sha256; None when it was stored without."""
        return self._read_part(version, "draft")

    def _read_part(self, version: str, part: str) -> tuple[bytes, bytes] | None:
        stored = self._load(version)
        if stored is None:
            raise AdapterNotFound(f"adapter version {version!r} not found")
        layouts = stored.part(part)
        return None if layouts is None else self._read(version, layouts)

    def _read(self, version: str, layouts) -> tuple[bytes, ...]:
        files = []
        for layout in layouts:
            data = self._chunks.read(layout)
            if data is None:
                raise AdapterNotFound(f"adapter version {version!r} was removed")
            if len(data) != layout.length or hashlib.sha256(data).hexdigest() != layout.sha256:
                raise AdapterCorrupted(f"adapter version {version!r} failed its checksum")
            files.append(data)
        return tuple(files)

    # ---- steps (separate methods so tests can fail them on purpose) ----

    def _stage(self, upload_id: str, payloads: dict[str, bytes]) -> None:
        self._chunks.stage(upload_id, payloads)

    def _run_commit(self, record: AdapterRecord, upload_id: str, replace: bool,
                    max_adapters: int | None, fields: dict, counts: Counter) -> list:
        return self._commit(
            keys=[self._keys.index(record.tenant), self._keys.version(record.version),
                  self._keys.retired, self._keys.tombstone(record.tenant),
                  self._keys.references(record.tenant)],
            args=[repr(record.created_at), record.name, record.version, int(replace),
                  -1 if max_adapters is None else max_adapters,
                  self._keys.version_prefix, self._keys.chunk_prefix,
                  self._keys.stage_prefix(upload_id), self._keys.events,
                  json.dumps(fields), json.dumps(dict(counts))])

    def _discard(self, upload_id: str, staged: set[str]) -> None:
        self._chunks.discard(upload_id, staged)

    # ---- helpers ------------------------------------------------------

    def _retire_index(self, index: str, tenant: str, tombstone: str,
                      tombstone_seconds: int) -> list[AdapterRecord]:
        now = self._clock()
        self.collect_garbage(now)
        reply = self._retire_all(keys=[index, self._keys.retired, tombstone],
                                 args=[repr(now), self._keys.version_prefix, self._keys.events,
                                       tenant, tombstone_seconds])
        records = [StoredVersion.parse(dict(zip(r[0::2], r[1::2]))).record for r in reply]
        return sorted(records, key=lambda r: r.name)

    def _load(self, version: str) -> StoredVersion | None:
        if not isinstance(version, str) or not _VERSION_RE.fullmatch(version):
            return None
        fields = self._redis.hgetall(self._keys.version(version))
        if not fields:
            return None
        stored = StoredVersion.parse(fields)
        if stored.retired_at is not None and self._clock() >= stored.retired_at + self._grace:
            return None  # past its grace: gone, even if not yet collected
        return stored

    @staticmethod
    def _quota_error(limit: int) -> AdapterQuotaExceeded:
        return AdapterQuotaExceeded("max_adapters", limit,
                                    f"tenant already has the maximum of {limit} adapters")
