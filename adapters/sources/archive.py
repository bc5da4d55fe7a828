"""The two PEFT files (and an adapter's own medusa/ heads beside them) out of a .tar, .tar.gz/.tgz or .zip held in memory, with every size bounded
(decompressed bytes, member count, each member) and only regular files read: links, devices and
paths are never followed or written anywhere."""
from __future__ import annotations

import gzip
import io
import posixpath
import tarfile
import zipfile
import zlib
from typing import IO

from adapters import medusa_format
from adapters.format import CONFIG_FILE, MAX_CONFIG_BYTES, PICKLE_FILE, WEIGHTS_FILE
from adapters.sources.errors import SourceError, too_large

MAX_MEMBERS = 256


def _bad(what: str, why: str) -> SourceError:
    return SourceError(400, f"{what}: {why}", "invalid_source")


def _pick(names: list[str], what: str) -> tuple[str, ...]:
    """The shallowest directory holding both files: their names, then its `medusa/` folder's two files' where
    it has that folder (an adapter's own Medusa heads, adapters.medusa_format)."""
    dirs = {}
    for name in names:
        d, base = posixpath.split(name.strip("/"))
        dirs.setdefault(d, set()).add(base)
    candidates = sorted((d for d, files in dirs.items() if {CONFIG_FILE, WEIGHTS_FILE} <= files),
                        key=lambda d: (d.count("/"), d))
    if not candidates:
        if any(PICKLE_FILE in files for files in dirs.values()):
            raise _bad(what, f"only {PICKLE_FILE} found; pickle files are never loaded, save the adapter with "
                             f"safe_serialization=True")
        raise _bad(what, f"the archive holds no directory with {CONFIG_FILE} and {WEIGHTS_FILE}")
    d = candidates[0]
    heads_dir = posixpath.join(d, medusa_format.ADAPTER_DIR)
    heads = tuple(posixpath.join(heads_dir, f) for f in (medusa_format.CONFIG_FILE, medusa_format.WEIGHTS_FILE))
    present = set(heads) & set(names)
    if present and present != set(heads):
        missing = posixpath.basename((set(heads) - present).pop())
        raise _bad(what, f"the adapter's {medusa_format.ADAPTER_DIR}/ folder has no {missing}")
    return (posixpath.join(d, CONFIG_FILE), posixpath.join(d, WEIGHTS_FILE)) + (heads if present else ())


_READ_CHUNK = 1 << 20


def _limit(name: str, cap: int) -> int:
    return MAX_CONFIG_BYTES if name.endswith(CONFIG_FILE) else cap


def _check_size(what: str, name: str, size: int, cap: int) -> None:
    """The member's declared size, before any of it is read."""
    if size > _limit(name, cap):
        raise too_large(f"{what}: {name}", size, _limit(name, cap))


def _read_bounded(f: IO[bytes], what: str, name: str, cap: int) -> bytes:
    """A member's bytes as they decompress, chunk by chunk, stopping one chunk past its limit: a
    member whose declared size lies (or a decompressor that does not check it) holds no more."""
    limit = _limit(name, cap)
    chunks, total = [], 0
    while chunk := f.read(min(_READ_CHUNK, limit + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise too_large(f"{what}: {name}", total, limit)
    return b"".join(chunks)


def _from_tar(data: bytes, cap: int, what: str) -> list[bytes]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            members = {}
            for i, member in enumerate(tf):
                if i >= MAX_MEMBERS:
                    raise _bad(what, f"more than {MAX_MEMBERS} archive members")
                if member.isreg():
                    members[member.name.strip("/")] = member
            files = []
            for name in _pick(list(members), what):
                _check_size(what, name, members[name].size, cap)
                f = tf.extractfile(members[name])
                assert f is not None  # a regular file
                files.append(_read_bounded(f, what, name, cap))
            return files
    except tarfile.TarError as e:
        raise _bad(what, f"not a readable tar archive ({e})") from None


def _from_zip(data: bytes, cap: int, what: str) -> list[bytes]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
            if len(infos) > MAX_MEMBERS:
                raise _bad(what, f"more than {MAX_MEMBERS} archive members")
            regular = {i.filename.strip("/"): i for i in infos if not i.is_dir()}
            files = []
            for name in _pick(list(regular), what):
                info = regular[name]
                _check_size(what, name, info.file_size, cap)
                if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                    raise _bad(what, f"{name}: unsupported zip compression")
                with zf.open(info) as f:
                    # zipfile also stops at the declared size and checks the CRC.
                    files.append(_read_bounded(f, what, name, cap))
            return files
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise _bad(what, f"not a readable zip archive ({e})") from None


def extract_adapter_files(data: bytes, name: str, cap: int, what: str) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) from an archive named `name`."""
    config, weights, _ = extract_adapter_archive(data, name, cap, what)
    return config, weights


def extract_adapter_archive(data: bytes, name: str, cap: int,
                            what: str) -> tuple[bytes, bytes, tuple[bytes, bytes] | None]:
    """(adapter_config.json, adapter_model.safetensors, its medusa/ folder's (medusa_config.json,
    medusa_heads.safetensors) or None) from an archive named `name`."""
    files = _members(data, name, cap, what)
    return files[0], files[1], (files[2], files[3]) if len(files) == 4 else None


def _members(data: bytes, name: str, cap: int, what: str) -> list[bytes]:
    lower = name.lower().split("?", 1)[0]
    if lower.endswith(".zip"):
        return _from_zip(data, cap, what)
    if lower.endswith((".tar.gz", ".tgz")):
        limit = cap + MAX_CONFIG_BYTES + (1 << 20)  # both files plus tar headers (heads share this bound)
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as gz:
                plain = _read_bounded(gz, what, "(decompressed)", limit)  # a gzip bomb stops here
        except (OSError, EOFError, zlib.error) as e:
            raise _bad(what, f"not a readable gzip stream ({e})") from None
        return _from_tar(plain, cap, what)
    return _from_tar(data, cap, what)
