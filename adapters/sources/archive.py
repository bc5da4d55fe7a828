"""The two PEFT files (and an adapter's optional parts beside them: adapters.optional_parts) out of a .tar, .tar.gz/.tgz or .zip held in memory, with every size bounded
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

from adapters.format import CONFIG_FILE, MAX_CONFIG_BYTES, PICKLE_FILE, WEIGHTS_FILE
from adapters.optional_parts import OPTIONAL_PARTS, half_part
from adapters.sources.errors import SourceError, too_large

MAX_MEMBERS = 256


def _bad(what: str, why: str) -> SourceError:
    return SourceError(400, f"{what}: {why}", "invalid_source")


def _pick(names: list[str], what: str) -> list[str | None]:
    """The shallowest directory holding both files: their names, then each optional part's two files
    (adapters.optional_parts: its folder beside them), None for a part it does not have."""
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
    picked: list[str | None] = [posixpath.join(d, CONFIG_FILE), posixpath.join(d, WEIGHTS_FILE)]
    for part in OPTIONAL_PARTS:
        paths = [posixpath.join(d, part.folder, f) for f in part.files]
        present = set(paths) & set(names)
        if present and present != set(paths):
            raise _bad(what, half_part(part, posixpath.basename((set(paths) - present).pop())))
        picked += paths if present else [None, None]
    return picked


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


def _from_tar(data: bytes, cap: int, what: str) -> list[bytes | None]:
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
                if name is None:  # an optional part it does not have
                    files.append(None)
                    continue
                _check_size(what, name, members[name].size, cap)
                f = tf.extractfile(members[name])
                assert f is not None  # a regular file
                files.append(_read_bounded(f, what, name, cap))
            return files
    except tarfile.TarError as e:
        raise _bad(what, f"not a readable tar archive ({e})") from None


def _from_zip(data: bytes, cap: int, what: str) -> list[bytes | None]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
            if len(infos) > MAX_MEMBERS:
                raise _bad(what, f"more than {MAX_MEMBERS} archive members")
            regular = {i.filename.strip("/"): i for i in infos if not i.is_dir()}
            files = []
            for name in _pick(list(regular), what):
                if name is None:
                    files.append(None)
                    continue
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
    config, weights, *_ = extract_adapter_archive(data, name, cap, what)
    return config, weights


def extract_adapter_archive(data: bytes, name: str, cap: int, what: str) -> tuple:
    """(adapter_config.json, adapter_model.safetensors, then each optional part's (config, weights) or None,
    in OPTIONAL_PARTS' order: medusa, draft) from an archive named `name`."""
    files = _members(data, name, cap, what)
    pairs = [None if files[i] is None else (files[i], files[i + 1]) for i in range(2, len(files), 2)]
    return files[0], files[1], *pairs


def _members(data: bytes, name: str, cap: int, what: str) -> list[bytes | None]:
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
