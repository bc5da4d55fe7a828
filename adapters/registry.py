"""The Redis adapter registry: who owns which adapter, and the adapter files.

Layout (prefix ``P``, default ``lp:``):
  P ad:idx:{tenant}     hash  name -> current version id (listing, count, quota)
  P ad:ver:{version}    hash  the immutable version record (+ retired_at once retired)
  P ad:chunk:{sha256}   hash  {data, refs}: content-addressed file chunks
  P ad:stage:{up}:{sha} hash  {data, refs=0}: an upload's chunks before commit, with a TTL
  P ad:retired          zset  version -> time it was replaced or deleted
  P adapter-events      pub/sub channel: {"event", "tenant", "name", "version"}

How each failure point of ``put`` is covered:
  1. Before staging (validation, 409, quota): nothing was written.
  2. While staging chunks: staging keys are written with their TTL in one
     MULTI/EXEC, so each is either absent or expiring. On an exception the
     upload deletes them; if the process dies they expire by themselves.
     Staging never touches permanent chunks or reference counts.
  3. The commit is one Lua script: it checks the name (409), the quota and
     that every chunk is present *before* its first write, then moves staged
     chunks to permanent keys, bumps reference counts, writes the record and
     the index entry. Redis runs it atomically, so no other client sees a
     half-commit and two commits never interleave (two racing uploads of one
     name: the second gets 409; racing uploads at the quota: one passes).
  4. Between staging and commit a permanent chunk we skipped staging may be
     collected; the commit then writes nothing and reports it missing, and
     the upload stages it and commits again.
  5. After the commit (the reply is lost): the adapter exists and is
     complete; leftover staging keys expire.
Replaced/deleted versions stay readable for ``grace_seconds`` (running
requests keep working) and are released by ``collect_garbage``, which every
put/delete runs first. The scripts derive some key names at run time, which
assumes a single Redis instance (not Redis Cluster).
"""
from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from adapters.chunks import ChunkedFile, ChunkStore, RegistryKeys, split
from adapters.registry_scripts import _COLLECT_LUA, _COMMIT_LUA, _DELETE_LUA

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_VERSION_RE = re.compile(r"[0-9a-f]{32}")
_COMMIT_ATTEMPTS = 4
_GC_BATCH = 64


class AdapterExists(Exception):
    """The tenant already has an adapter of that name (and replace was not asked)."""


class AdapterNotFound(Exception):
    """No such adapter or version (or it was retired and its grace has passed)."""


class AdapterCorrupted(Exception):
    """Stored bytes no longer match the checksum recorded at upload."""


class AdapterQuotaExceeded(Exception):
    def __init__(self, limit_name: str, limit: int, message: str) -> None:
        super().__init__(message)
        self.limit_name = limit_name
        self.limit = limit


@dataclass(frozen=True)
class AdapterRecord:
    tenant: str
    name: str
    version: str
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int
    created_at: float

    def public(self) -> dict:
        return {"id": self.version, "name": self.name, "version": self.version,
                "rank": self.rank, "target_modules": list(self.target_modules),
                "size_bytes": self.size_bytes, "created_at": self.created_at}


@dataclass(frozen=True)
class _StoredVersion:
    record: AdapterRecord
    config: ChunkedFile
    weights: ChunkedFile
    retired_at: float | None


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid adapter name {name!r}: use 1-64 characters from "
                         "A-Z a-z 0-9 . _ -, starting with a letter or digit")
    return name


def _validate_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not tenant or len(tenant) > 128 or not tenant.isprintable():
        raise ValueError(f"invalid tenant {tenant!r}: need 1-128 printable characters")
    return tenant


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parse_version(fields: dict) -> _StoredVersion:
    f = {_text(k): _text(v) for k, v in fields.items()}
    record = AdapterRecord(
        tenant=f["tenant"], name=f["name"], version=f["version"], rank=int(f["rank"]),
        target_modules=tuple(json.loads(f["target_modules"])),
        size_bytes=int(f["size_bytes"]), created_at=float(f["created_at"]))
    config = ChunkedFile(f["config_sha256"], int(f["config_len"]), tuple(json.loads(f["config_chunks"])))
    weights = ChunkedFile(f["weights_sha256"], int(f["weights_len"]), tuple(json.loads(f["weights_chunks"])))
    retired = f.get("retired_at")
    return _StoredVersion(record, config, weights, None if retired is None else float(retired))


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
        self._collect = redis.register_script(_COLLECT_LUA)

    @property
    def events_channel(self) -> str:
        return self._keys.events

    # ---- writes -------------------------------------------------------

    def put(self, tenant: str, name: str, config_json: bytes, weights: bytes, *, summary,
            replace: bool = False, max_adapters: int | None = None) -> AdapterRecord:
        """Store a validated adapter; all-or-nothing (see the module docstring)."""
        _validate_tenant(tenant)
        validate_name(name)
        if max_adapters is not None and max_adapters < 0:
            raise ValueError("max_adapters must be >= 0")
        now = self._clock()
        self.collect_garbage(now)
        index = self._keys.index(tenant)
        # Cheap early refusals so a doomed upload sends no chunks; the commit re-checks.
        exists = self._redis.hexists(index, name)
        if exists and not replace:
            raise AdapterExists(f"adapter {name!r} already exists")
        if not exists and max_adapters is not None and self._redis.hlen(index) >= max_adapters:
            raise self._quota_error(max_adapters)

        config_layout, config_chunks = split(config_json, self._chunk_size)
        weights_layout, weights_chunks = split(weights, self._chunk_size)
        payloads = {**config_chunks, **weights_chunks}
        counts = Counter(config_layout.digests + weights_layout.digests)
        record = AdapterRecord(tenant, name, uuid.uuid4().hex, int(summary.rank),
                               tuple(summary.target_modules), int(summary.size_bytes), now)
        fields = self._record_fields(record, config_layout, weights_layout)
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
                assert status == "missing", status
                # Chunks we counted on were collected meanwhile; send them too.
                to_stage = {_text(d) for d in reply[1:]}
            raise RuntimeError(f"upload of {name!r} kept losing chunks to garbage collection")
        finally:
            # After a commit the staged keys are already gone (moved or deleted);
            # after any failure they must not outlive the upload.
            self._discard(upload_id, staged)

    def delete(self, tenant: str, name: str) -> AdapterRecord | None:
        """Remove the name now; its version stays readable for the grace period."""
        _validate_tenant(tenant)
        validate_name(name)
        now = self._clock()
        self.collect_garbage(now)
        reply = self._delete(keys=[self._keys.index(tenant), self._keys.retired],
                             args=[repr(now), name, self._keys.version_prefix,
                                   self._keys.events, tenant])
        if not reply:
            return None
        return _parse_version(dict(zip(reply[0::2], reply[1::2]))).record

    def collect_garbage(self, now: float | None = None) -> int:
        """Release versions retired more than grace_seconds ago; returns how many."""
        now = self._clock() if now is None else now
        cutoff = repr(now - self._grace)
        released = 0
        while True:
            n = int(self._collect(keys=[self._keys.retired],
                                  args=[cutoff, _GC_BATCH, self._keys.version_prefix,
                                        self._keys.chunk_prefix]))
            released += n
            if n < _GC_BATCH:
                return released

    # ---- reads --------------------------------------------------------

    def get(self, tenant: str, name: str) -> AdapterRecord | None:
        _validate_tenant(tenant)
        validate_name(name)
        version = self._redis.hget(self._keys.index(tenant), name)
        if version is None:
            return None
        stored = self._load(_text(version))
        return None if stored is None else stored.record

    def get_version(self, version: str, tenant: str | None = None) -> AdapterRecord | None:
        """The record of a version id, current or within its grace period.
        Pass ``tenant`` to get None for another tenant's version."""
        stored = self._load(version)
        if stored is None or (tenant is not None and stored.record.tenant != tenant):
            return None
        return stored.record

    def list(self, tenant: str) -> list[AdapterRecord]:
        _validate_tenant(tenant)
        versions = [_text(v) for v in self._redis.hvals(self._keys.index(tenant))]
        pipe = self._redis.pipeline(transaction=False)
        for v in versions:
            pipe.hgetall(self._keys.version(v))
        # A record can vanish between the two reads (deleted and collected): skip it.
        records = [_parse_version(f).record for f in pipe.execute() if f]
        return sorted(records, key=lambda r: r.name)

    def count(self, tenant: str) -> int:
        _validate_tenant(tenant)
        return int(self._redis.hlen(self._keys.index(tenant)))

    def read_files(self, version: str) -> tuple[bytes, bytes]:
        """(adapter_config.json, adapter_model.safetensors) of a version, checked
        against the upload's sha256."""
        stored = self._load(version)
        if stored is None:
            raise AdapterNotFound(f"adapter version {version!r} not found")
        files = []
        for layout in (stored.config, stored.weights):
            data = self._chunks.read(layout)
            if data is None:
                raise AdapterNotFound(f"adapter version {version!r} was removed")
            if len(data) != layout.length or hashlib.sha256(data).hexdigest() != layout.sha256:
                raise AdapterCorrupted(f"adapter version {version!r} failed its checksum")
            files.append(data)
        return files[0], files[1]

    # ---- steps (separate methods so tests can fail them on purpose) ----

    def _stage(self, upload_id: str, payloads: dict[str, bytes]) -> None:
        self._chunks.stage(upload_id, payloads)

    def _run_commit(self, record: AdapterRecord, upload_id: str, replace: bool,
                    max_adapters: int | None, fields: dict, counts: Counter) -> list:
        return self._commit(
            keys=[self._keys.index(record.tenant), self._keys.version(record.version),
                  self._keys.retired],
            args=[repr(record.created_at), record.name, record.version, int(replace),
                  -1 if max_adapters is None else max_adapters,
                  self._keys.version_prefix, self._keys.chunk_prefix,
                  self._keys.stage_prefix(upload_id), self._keys.events,
                  json.dumps(fields), json.dumps(dict(counts))])

    def _discard(self, upload_id: str, staged: set[str]) -> None:
        self._chunks.discard(upload_id, staged)

    # ---- helpers ------------------------------------------------------

    def _load(self, version: str) -> _StoredVersion | None:
        if not isinstance(version, str) or not _VERSION_RE.fullmatch(version):
            return None
        fields = self._redis.hgetall(self._keys.version(version))
        if not fields:
            return None
        stored = _parse_version(fields)
        if stored.retired_at is not None and self._clock() >= stored.retired_at + self._grace:
            return None  # past its grace: gone, even if not yet collected
        return stored

    @staticmethod
    def _record_fields(record: AdapterRecord, config: ChunkedFile, weights: ChunkedFile) -> dict:
        return {"tenant": record.tenant, "name": record.name, "version": record.version,
                "rank": str(record.rank), "target_modules": json.dumps(list(record.target_modules)),
                "size_bytes": str(record.size_bytes), "created_at": repr(record.created_at),
                "config_sha256": config.sha256, "config_len": str(config.length),
                "config_chunks": json.dumps(list(config.digests)),
                "weights_sha256": weights.sha256, "weights_len": str(weights.length),
                "weights_chunks": json.dumps(list(weights.digests))}

    @staticmethod
    def _quota_error(limit: int) -> AdapterQuotaExceeded:
        return AdapterQuotaExceeded("max_adapters", limit,
                                    f"tenant already has the maximum of {limit} adapters")
