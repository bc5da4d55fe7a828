"""fetch_adapter: a reference's two PEFT files, from whichever allowed source it names.
Blocking (network, disk): call it off the event loop."""
from __future__ import annotations

import hashlib
import posixpath
import ssl
import time
from dataclasses import dataclass

from adapters.format import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE
from adapters.sources.archive import extract_adapter_files
from adapters.sources.errors import refused
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

    @property
    def sha256(self) -> str:
        """The content's identity: it changes exactly when either file does."""
        h = hashlib.sha256()
        for data in (self.config_json, self.weights):
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
        return AdapterFiles(*extract_adapter_files(data, ref.location, policy.max_file_bytes, str(ref)))
    config = reader.get(posixpath.join(ref.location, CONFIG_FILE), MAX_CONFIG_BYTES)
    return AdapterFiles(config, reader.get(posixpath.join(ref.location, WEIGHTS_FILE), policy.max_file_bytes))


def _from_http(ref: SourceRef, policy: SourcePolicy, deadline: float, tls: ssl.SSLContext) -> AdapterFiles:
    if not policy.allows(ref.kind):
        raise refused(f"{ref.kind}:// adapter sources are not allowed on this server")
    if ref.is_archive:
        data = http_get(ref.location, policy, _archive_cap(policy), deadline, ref.location, tls)
        return AdapterFiles(*extract_adapter_files(data, ref.location, policy.max_file_bytes, ref.location))
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
        return AdapterFiles(*extract_adapter_files(data, path.name, policy.max_file_bytes, ref.location))
    return AdapterFiles(read_local_file(path / CONFIG_FILE, root, MAX_CONFIG_BYTES, ref.location),
                        read_local_file(path / WEIGHTS_FILE, root, policy.max_file_bytes, ref.location))


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
