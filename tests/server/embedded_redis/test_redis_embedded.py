"""EmbeddedRedis: a real redis-server child, bound to localhost, password-protected,
persisting to its data dir, and restarted by its supervisor when it dies."""
from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from server.embedded_redis.server import EmbeddedRedis, EmbeddedRedisError, find_redis_server, free_port


def test_find_redis_server_is_executable() -> None:
    exe = find_redis_server()
    assert os.access(exe, os.X_OK), exe


def test_restart_on_same_data_dir_keeps_data(tmp_path: Path) -> None:
    with EmbeddedRedis.start(tmp_path) as first:
        assert first.url == f"redis://:{quote(first.password, safe='')}@127.0.0.1:{first.port}/0"
        assert first.url_for(3).endswith(f"@127.0.0.1:{first.port}/3")
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
        assert redis.Redis(host="127.0.0.1", port=port, password=server.password).ping()


def test_failed_start_reports_the_server_output(tmp_path: Path) -> None:
    fake = tmp_path / "fake-redis-server"
    fake.write_text("#!/bin/sh\necho 'fatal: cannot frobnicate' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(EmbeddedRedisError, match="(?s)status 3.*cannot frobnicate"):
        EmbeddedRedis.start(tmp_path / "data", executable=str(fake), timeout=5)


def test_stop_is_idempotent_and_does_not_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis.start(tmp_path)
    server.stop()
    server.stop()
    time.sleep(0.5)  # several initial backoff delays: a supervisor still running would relaunch
    assert server.restarts == 0
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(host="127.0.0.1", port=server.port, socket_connect_timeout=0.5,
                    retry=Retry(NoBackoff(), 0)).ping()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _unauthenticated_reply(port: int, command: bytes) -> bytes:
    """Raw RESP, so the refusal is redis-server's and not a client-side check."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(command + b"\r\n")
        return sock.recv(4096)


def test_clients_without_the_password_are_refused(tmp_path: Path) -> None:
    with EmbeddedRedis.start(tmp_path) as server:
        assert _unauthenticated_reply(server.port, b"SET lp:tenant:evil x").startswith(b"-NOAUTH")
        reply = _unauthenticated_reply(server.port, b"CONFIG SET requirepass x")
        assert reply.startswith(b"-NOAUTH")
        for password in (None, "wrong"):
            with pytest.raises(redis.AuthenticationError):
                # No retries: redis-py counts an auth failure as a connection error and retries it.
                redis.Redis(host="127.0.0.1", port=server.port, password=password,
                            retry=Retry(NoBackoff(), 0)).ping()
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.exists("lp:tenant:evil") == 0
        assert client.config_get("requirepass")["requirepass"] == server.password
        client.close()


def test_password_file_is_private_and_reused(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # a permissive umask must not leak into the secret files' modes
    try:
        with EmbeddedRedis.start(tmp_path) as first:
            password = first.password
            assert first.password_file.read_text().strip() == password
            assert _mode(first.password_file) == 0o600
            assert _mode(tmp_path / "redis.conf") == 0o600
            assert password not in " ".join(_cmdline(first.pid))
    finally:
        os.umask(old_umask)
    assert not list(tmp_path.glob(".*.tmp")), "staging files must not be left behind"
    first.password_file.chmod(0o644)
    with EmbeddedRedis.start(tmp_path) as second:
        assert second.password == password
        assert _mode(second.password_file) == 0o600
        assert redis.Redis.from_url(second.url).ping()


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_data_dir_from_before_passwords_gets_one(tmp_path: Path) -> None:
    with EmbeddedRedis.start(tmp_path) as first:
        redis.Redis.from_url(first.url).set("lp:probe", "kept")
        old_password = first.password
    first.password_file.unlink()
    with EmbeddedRedis.start(tmp_path) as second:
        assert second.password != old_password
        assert _mode(second.password_file) == 0o600
        assert redis.Redis.from_url(second.url).get("lp:probe") == b"kept"


def _wait_aof_written(client: redis.Redis) -> None:
    """Until redis has write()n its AOF buffer: from then on, a kill -9 of the
    process (as opposed to a host crash) loses nothing."""
    deadline = time.monotonic() + 5
    while client.info("persistence")["aof_buffer_length"] != 0:
        assert time.monotonic() < deadline, "AOF buffer never drained"
        time.sleep(0.02)


def test_killed_redis_is_restarted_with_its_data(tmp_path: Path) -> None:
    with EmbeddedRedis.start(tmp_path) as server:
        client = redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=1)
        client.hset("lp:tenant:acme", mapping={"quota": "{}"})
        _wait_aof_written(client)
        old_pid, port = server.pid, server.port
        server.kill()
        server.wait_until_up(timeout=10)
        assert server.restarts == 1
        assert server.pid != old_pid and server.port == port
        # kill -9 left the dead child's pidfile behind; it must not have blocked the restart.
        assert (tmp_path / "redis.pid").read_text().strip() == str(server.pid)
        # The same client object: redis-py reconnects on its own after the drop.
        deadline = time.monotonic() + 5
        while True:
            try:
                assert client.hgetall("lp:tenant:acme") == {"quota": "{}"}
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "client never reconnected"
                time.sleep(0.05)
        assert _unauthenticated_reply(port, b"GET lp:tenant:acme").startswith(b"-NOAUTH")
        client.close()


def test_paused_supervision_keeps_redis_down_until_resumed(tmp_path: Path) -> None:
    with EmbeddedRedis.start(tmp_path) as server:
        with server.pause_supervision():
            server.kill()
            time.sleep(0.6)  # well past the first backoff delay
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
            assert server.restarts == 0
        server.wait_until_up(timeout=10)
        assert server.restarts == 1
        assert redis.Redis.from_url(server.url).ping()


def test_instant_deaths_back_off_then_recover(tmp_path: Path) -> None:
    # A redis-server that dies at once while `broken` exists, like one with a
    # corrupt config or a port another process grabbed.
    broken = tmp_path / "broken"
    flaky = tmp_path / "flaky-redis-server"
    flaky.write_text(f'#!/bin/sh\n[ -e "{broken}" ] && exit 1\nexec "{find_redis_server()}" "$@"\n')
    flaky.chmod(flaky.stat().st_mode | stat.S_IXUSR)
    with EmbeddedRedis.start(tmp_path / "data", executable=str(flaky)) as server:
        broken.touch()
        server.kill()
        time.sleep(2.0)
        # Delays 0.1, 0.2, 0.4, 0.8 s: four tries in two seconds; a spinning loop makes hundreds.
        assert 2 <= server.restarts <= 6, server.restarts
        broken.unlink()
        server.wait_until_up(timeout=10)
        assert redis.Redis.from_url(server.url).ping()
        tries = server.restarts
        time.sleep(0.5)
        assert server.restarts == tries, "a healthy child must not be relaunched"
