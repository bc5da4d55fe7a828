"""fetch_adapter: a reference's two PEFT files, from whichever allowed source it names, and the adapter's
optional parts beside them (adapters.optional_parts: its `medusa/` heads and `draft/` LoRA): a local
directory's folders, an archive's members, and an http(s) or s3 directory's files fetched by their known
names, a 404 meaning the part is absent.
Blocking (network, disk): call it off the event loop."""
from __future__ import annotations

import hashlib
import posixpath
import ssl
import time
from dataclasses import dataclass
from typing import Callable

from adapters.format import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE
from adapters.optional_parts import OPTIONAL_PARTS, OptionalPart, half_part
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
    # Its draft LoRA's files (its draft/ folder's adapter_config.json, adapter_model.safetensors), unchecked.
    draft: tuple[bytes, bytes] | None = None

    @property
    def sha256(self) -> str:
        """The content's identity: it changes exactly when any file does (optional parts included)."""
        h = hashlib.sha256()
        for data in (self.config_json, self.weights, *(self.medusa or ())):
            h.update(len(data).to_bytes(8, "big"))
            h.update(data)
        if self.draft is not None:  # tagged: the same bytes as heads or as a draft LoRA are other content
            h.update(b"draft")
            for data in self.draft:
                h.update(len(data).to_bytes(8, "big"))
                h.update(data)
        return h.hexdigest()


def _optional_parts(get: Callable[[OptionalPart, str, int], bytes | None], what: str,
                    file_cap: int) -> dict[str, tuple[bytes, bytes]]:
    """Each optional part's two files by `get(part, file, cap)` (None: absent; the weights' cap is the
    source's per-file one); both or neither, else a 400 naming the missing one. Keyed by AdapterFiles field."""
    parts = {}
    for part in OPTIONAL_PARTS:
        files = [get(part, name, cap) for name, cap in zip(part.files, (part.config_cap, file_cap))]
        if None in files and files != [None, None]:
            raise _half(what, part, part.files[files.index(None)])
        if files[0] is not None:
            parts[part.name] = (files[0], files[1])
    return parts


def _half(what: str, part: OptionalPart, missing: str) -> SourceError:
    return SourceError(400, f"{what}: {half_part(part, missing)}", "invalid_source")


def _absent_on_404(fetch: Callable[[], bytes]) -> bytes | None:
    """An optional file fetched by name: None where the source has no such file."""
    try:
        return fetch()
    except SourceError as e:
        if e.status == 404:
            return None
        raise


def _archive_cap(policy: SourcePolicy) -> int:
    return policy.max_file_bytes + MAX_CONFIG_BYTES


def _from_s3(ref: SourceRef, policy: SourcePolicy, deadline: float, clients: S3Clients,
             keys: S3Keys | None) -> AdapterFiles:
    reader = S3Reader(policy, ref.bucket, deadline, clients, keys)
    if ref.is_archive:
        data = reader.get(ref.location, _archive_cap(policy))
        return AdapterFiles(*extract_adapter_archive(data, ref.location, policy.max_file_bytes, str(ref)))
    config = reader.get(posixpath.join(ref.location, CONFIG_FILE), MAX_CONFIG_BYTES)
    weights = reader.get(posixpath.join(ref.location, WEIGHTS_FILE), policy.max_file_bytes)
    parts = _optional_parts(lambda part, name, cap: _absent_on_404(
        lambda: reader.get(posixpath.join(ref.location, part.folder, name), cap)), str(ref), policy.max_file_bytes)
    return AdapterFiles(config, weights, **parts)


def _from_http(ref: SourceRef, policy: SourcePolicy, deadline: float, tls: ssl.SSLContext) -> AdapterFiles:
    if not policy.allows(ref.kind):
        raise refused(f"{ref.kind}:// adapter sources are not allowed on this server")
    if ref.is_archive:
        data = http_get(ref.location, policy, _archive_cap(policy), deadline, ref.location, tls)
        return AdapterFiles(*extract_adapter_archive(data, ref.location, policy.max_file_bytes, ref.location))
    base = ref.location if ref.location.endswith("/") else ref.location + "/"
    config = http_get(base + CONFIG_FILE, policy, MAX_CONFIG_BYTES, deadline, base + CONFIG_FILE, tls)
    weights = http_get(base + WEIGHTS_FILE, policy, policy.max_file_bytes, deadline, base + WEIGHTS_FILE, tls)

    def optional(part: OptionalPart, name: str, cap: int) -> bytes | None:
        url = f"{base}{part.folder}/{name}"
        return _absent_on_404(lambda: http_get(url, policy, cap, deadline, url, tls))

    return AdapterFiles(config, weights, **_optional_parts(optional, ref.location, policy.max_file_bytes))


def _from_local(ref: SourceRef, policy: SourcePolicy) -> AdapterFiles:
    path = resolve_local(ref.location, policy)
    root = policy.local_root
    assert root is not None
    if path.is_file():
        data = read_local_file(path, root, _archive_cap(policy), ref.location)
        return AdapterFiles(*extract_adapter_archive(data, path.name, policy.max_file_bytes, ref.location))
    config = read_local_file(path / CONFIG_FILE, root, MAX_CONFIG_BYTES, ref.location)
    weights = read_local_file(path / WEIGHTS_FILE, root, policy.max_file_bytes, ref.location)

    def optional(part: OptionalPart, name: str, cap: int) -> bytes | None:
        folder = path / part.folder
        if not folder.exists():
            return None
        if not (folder / name).is_file():  # the folder is the part: each of its files is needed
            raise _half(ref.location, part, name)
        return read_local_file(folder / name, root, cap, f"{ref.location}: {part.folder}")

    return AdapterFiles(config, weights, **_optional_parts(optional, ref.location, policy.max_file_bytes))


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
