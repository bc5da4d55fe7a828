"""Read an adapter from a directory (or archive file) under the operator's root. The path is
resolved (symlinks included) before the check, so neither `..` nor a link leads out of the root."""
from __future__ import annotations

import os
from pathlib import Path

from adapters.format import CONFIG_FILE, MAX_CONFIG_BYTES, PICKLE_FILE, WEIGHTS_FILE
from adapters.sources.errors import SourceError, refused, too_large
from adapters.sources.policy import SourcePolicy


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def resolve_local(text: str, policy: SourcePolicy) -> Path:
    if not policy.allows("local"):
        raise refused("local adapter directories are not allowed on this server")
    root = policy.local_root
    assert root is not None  # SourcePolicy requires it with `local`
    path = (root / text).resolve()  # an absolute `text` replaces the root, then must lie under it
    if not _inside(path, root):
        raise refused(f"{text!r} is not under the server's adapter root")
    if not path.exists():
        raise SourceError(404, f"adapter directory {text!r} does not exist", "source_not_found")
    return path


def read_local_file(path: Path, root: Path, cap: int, what: str) -> bytes:
    real = path.resolve()
    if not _inside(real, root) or not real.is_file():
        if path.name == WEIGHTS_FILE and (path.parent / PICKLE_FILE).exists():
            raise SourceError(400, f"{what}: only {PICKLE_FILE} found; pickle files are never loaded",
                              "invalid_source")
        raise SourceError(404, f"{what}: no {path.name}", "source_not_found")
    size = os.stat(real).st_size
    limit = MAX_CONFIG_BYTES if path.name == CONFIG_FILE else cap
    if size > limit:
        raise too_large(f"{what}: {path.name}", size, limit)
    with open(real, "rb") as f:
        data = f.read(limit + 1)  # the file may have grown since the stat
    if len(data) > limit:
        raise too_large(f"{what}: {path.name}", len(data), limit)
    return data
