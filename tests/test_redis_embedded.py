"""EmbeddedRedis: a real redis-server child, bound to localhost, persisting to its data dir."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from server.redis_embedded import EmbeddedRedis, EmbeddedRedisError, find_redis_server, free_port


def test_find_redis_server_is_executable() -> None:
    exe = find_redis_server()
    assert os.access(exe, os.X_OK), exe


def test_restart_on_same_data_dir_keeps_data(tmp_path: Path) -> None:
    with EmbeddedRedis.start(tmp_path) as first:
        assert first.url == f"redis://127.0.0.1:{first.port}/0"
        client = redis.Redis.from_url(first.url, decode_responses=True)
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("protected-mode")["protected-mode"] == "yes"
        assert Path(client.config_get("dir")["dir"]) == tmp_path.resolve()
        client.set("lp:probe", "kept")
        client.hset("lp:tenant:acme", mapping={"quota": "{}"})
        client.close()
        first_pid = first.pid
    assert first._proc.poll() is not None, "stop() must wait for the process to exit"

    with EmbeddedRedis.start(tmp_path) as second:
        assert second.pid != first_pid
        client = redis.Redis.from_url(second.url, decode_responses=True)
        assert client.get("lp:probe") == "kept"
        assert client.hgetall("lp:tenant:acme") == {"quota": "{}"}
        client.close()


def test_second_server_on_same_data_dir_is_refused(tmp_path: Path) -> None:
    with EmbeddedRedis.start(tmp_path):
        with pytest.raises(EmbeddedRedisError, match="already using"):
            EmbeddedRedis.start(tmp_path)


def test_explicit_port_is_used(tmp_path: Path) -> None:
    port = free_port()
    with EmbeddedRedis.start(tmp_path, port=port) as server:
        assert server.port == port
        assert redis.Redis(host="127.0.0.1", port=port).ping()


def test_failed_start_reports_the_server_output(tmp_path: Path) -> None:
    fake = tmp_path / "fake-redis-server"
    fake.write_text("#!/bin/sh\necho 'fatal: cannot frobnicate' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(EmbeddedRedisError, match="(?s)status 3.*cannot frobnicate"):
        EmbeddedRedis.start(tmp_path / "data", executable=str(fake), timeout=5)


def test_stop_is_idempotent(tmp_path: Path) -> None:
    server = EmbeddedRedis.start(tmp_path)
    server.stop()
    server.stop()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(host="127.0.0.1", port=server.port, socket_connect_timeout=0.5,
                    retry=Retry(NoBackoff(), 0)).ping()
