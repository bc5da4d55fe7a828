"""fetch_adapter: a reference's two PEFT files, from whichever allowed source it names, and the adapter's own
Medusa heads (its `medusa/` folder, adapters.medusa_format) where the source is a local directory or an
archive (whose members are listed): http and S3 directories are fetched by file name, the two PEFT files
only, so they carry no heads (docs/speculative-decoding.md).
Blocking (network, disk): call it off the event loop."""
from __future__ import annotations

import hashlib
import posixpath
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

from adapters import medusa_format
from adapters.format import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE
from adapters.sources.archive import extract_adapter_archive
from adapters.sources.errors import SourceError, refused
from adapters.sources.http_fetch import http_get
from adapters.sources.local_fetch import read_local_file, resolve_local
from adapters.sources.policy import SourcePolicy
from adapters.sources.reference import SourceRef
from adapters.sources.clients import SourceClients
from adapters.sources.s3_fetch import S3Clients, S3Keys, S3Reader


@dataclass(frozen=True)
class AdapterFiles:
    config_json: bytes
    weights: bytes
    # The adapter's own Medusa heads files (medusa_config.json, medusa_heads.safetensors), unchecked; None without.
    medusa: tuple[bytes, bytes] | None = None

    @property
    def sha256(self) -> str:
        """The content's identity: it changes exactly when any file does (heads included)."""
        h = hashlib.sha256()
        for data in (self.config_json, self.weights, *(self.medusa or ())):
            h.update(len(data).to_bytes(8, "big"))
            h.update(data)
        return h.hexdigest()


def _archive_cap(policy: SourcePolicy) -> int:
    return policy.max_file_bytes + MAX_CONFIG_BYTES


def _from_s3(ref: SourceRef, policy: SourcePolicy, deadline: float, clients: S3Clients,
             keys: S3Keys | None) -> AdapterFiles:
    reader = S3Reader(policy, ref.bucket, deadline, clients, keys)
    if ref.is_archive:
        data = reader.get(ref.location, _archive_cap(policy))
        return AdapterFiles(*extract_adapter_archive(data, ref.location, policy.max_file_bytes, str(ref)))
    config = reader.get(posixpath.join(ref.location, CONFIG_FILE), MAX_CONFIG_BYTES)
    return AdapterFiles(config, reader.get(posixpath.join(ref.location, WEIGHTS_FILE), policy.max_file_bytes))


def _from_http(ref: SourceRef, policy: SourcePolicy, deadline: float, tls: ssl.SSLContext) -> AdapterFiles:
    if not policy.allows(ref.kind):
        raise refused(f"{ref.kind}:// adapter sources are not allowed on this server")
    if ref.is_archive:
        data = http_get(ref.location, policy, _archive_cap(policy), deadline, ref.location, tls)
        return AdapterFiles(*extract_adapter_archive(data, ref.location, policy.max_file_bytes, ref.location))
    base = ref.location if ref.location.endswith("/") else ref.location + "/"
    config = http_get(base + CONFIG_FILE, policy, MAX_CONFIG_BYTES, deadline, base + CONFIG_FILE, tls)
    return AdapterFiles(config, http_get(base + WEIGHTS_FILE, policy, policy.max_file_bytes, deadline,
                                         base + WEIGHTS_FILE, tls))


def _from_local(ref: SourceRef, policy: SourcePolicy) -> AdapterFiles:
    path = resolve_local(ref.location, policy)
    root = policy.local_root
    assert root is not None
    if path.is_file():
        data = read_local_file(path, root, _archive_cap(policy), ref.location)
        return AdapterFiles(*extract_adapter_archive(data, path.name, policy.max_file_bytes, ref.location))
    return AdapterFiles(read_local_file(path / CONFIG_FILE, root, MAX_CONFIG_BYTES, ref.location),
                        read_local_file(path / WEIGHTS_FILE, root, policy.max_file_bytes, ref.location),
                        _local_heads(path, root, policy, ref.location))


def _local_heads(path: Path, root: Path, policy: SourcePolicy, what: str) -> tuple[bytes, bytes] | None:
    """A local directory's `medusa/` folder's two files (checked against the base by the store, as an
    upload's are); None without the folder, a 400 naming the one missing."""
    heads = path / medusa_format.ADAPTER_DIR
    if not heads.exists():
        return None
    files = []
    for name, cap in ((medusa_format.CONFIG_FILE, medusa_format.MAX_CONFIG_BYTES),
                      (medusa_format.WEIGHTS_FILE, policy.max_file_bytes)):
        if not (heads / name).is_file():
            raise SourceError(400, f"{what}: the adapter's {medusa_format.ADAPTER_DIR}/ folder has no {name}",
                              "invalid_source")
        files.append(read_local_file(heads / name, root, cap, f"{what}: {medusa_format.ADAPTER_DIR}"))
    return files[0], files[1]


def fetch_adapter(ref: SourceRef, policy: SourcePolicy, clients: SourceClients | None = None,
                  s3_keys: S3Keys | None = None) -> AdapterFiles:
    """SourceError (with its HTTP status) when the source is not allowed, missing, too large,
    failing or slower than policy.timeout_seconds in all. `clients`: a server's shared clients
    (None: made for this fetch). `s3_keys`: the caller's own S3 credentials (None: the server's)."""
    deadline = time.monotonic() + policy.timeout_seconds
    clients = clients or SourceClients()
    if ref.kind == "s3":
        return _from_s3(ref, policy, deadline, clients.s3, s3_keys)
    if ref.kind in ("http", "https"):
        return _from_http(ref, policy, deadline, clients.tls)
    assert ref.kind == "local", ref.kind
    return _from_local(ref, policy)
