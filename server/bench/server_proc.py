"""A `loraplex serve` child process for the bench, and its provisioning over HTTP:
tenants and keys via /admin, adapters via POST /v1/adapters (the way a user would)."""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx

from server.bench.client import BenchClientError
from server.bench.proc_stat import cpu_s, stat_fields


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _runnable(script: Path) -> bool:
    """The script's #! interpreter exists (an editable install made from another checkout's venv names
    that venv's python, which may be gone)."""
    with open(script, "rb") as f:
        first = f.readline()
    return not first.startswith(b"#!") or Path(first[2:].split()[0].decode()).exists()


def _serve_argv() -> list[str]:
    script = Path(sys.executable).parent / "loraplex"
    if script.is_file() and _runnable(script):
        return [str(script), "serve"]
    return [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())", "serve"]


class ServerProcess:
    """Start with `with ServerProcess(...) as srv:`; srv.url, srv.admin_token. The
    server's output goes to log_path, which error messages point at."""

    def __init__(self, data_dir: Path, log_path: Path, *, model_dir: Path | None, serve_args: list[str],
                 startup_timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_token = "lpadm-bench-" + secrets.token_urlsafe(16)
        self.log_path = log_path
        argv = _serve_argv() + ["--port", str(self.port), "--data-dir", str(data_dir),
                                "--admin-token", self.admin_token, *serve_args]
        if model_dir is not None:
            argv += ["--model", str(model_dir)]
        self.argv = argv
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)  # the tests' interpreter flag would make GPU kernels crawl
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=repo)
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchClientError(f"loraplex serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise BenchClientError(f"loraplex serve not healthy after {self.startup_timeout_s:.0f}s; see {self.log_path}")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far (all its threads; Linux /proc)."""
        return cpu_s(stat_fields(self.proc.pid))

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _check(resp: httpx.Response, what: str) -> dict:
    if resp.status_code not in (200, 201):
        raise BenchClientError(f"{what}: HTTP {resp.status_code} {resp.text[:300]}")
    return resp.json()


def provision(url: str, admin_token: str, tenants: list[str], adapters: dict[str, tuple[str, Path]]
              ) -> tuple[dict[str, str], str]:
    """Create tenants (unlimited quota) with one key each and upload adapters
    (name -> (tenant, dir)). Returns (tenant -> key, base model id)."""
    admin = {"Authorization": f"Bearer {admin_token}"}
    keys: dict[str, str] = {}
    with httpx.Client(base_url=url, timeout=120.0) as c:
        for t in tenants:
            _check(c.post("/admin/tenants", json={"name": t}, headers=admin), f"create tenant {t}")
            keys[t] = _check(c.post(f"/admin/tenants/{t}/keys", headers=admin), f"key for {t}")["key"]
        for name, (tenant, path) in adapters.items():
            files = {f: (f, (Path(path) / f).read_bytes()) for f in ("adapter_config.json",
                                                                    "adapter_model.safetensors")}
            _check(c.post("/v1/adapters", data={"name": name}, files=files,
                          headers={"Authorization": f"Bearer {keys[tenant]}"}), f"upload {name}")
        models = _check(c.get("/v1/models", headers={"Authorization": f"Bearer {keys[tenants[0]]}"}), "models")
    base = next(m["id"] for m in models["data"] if m.get("parent") is None)
    return keys, base


@contextmanager
def bench_server(work_dir: str | Path, model_dir: Path, serve_args: list[str], requests, named: dict[str, Path],
                 log: Callable[[str], None], on_start: Callable[[ServerProcess], None] | None = None
                 ) -> Iterator[tuple[str, dict[str, str], str]]:
    """A provisioned, warmed-up server for a run: (url, tenant -> key, base model id). The warm-up
    sends a short request per adapter, so each is loaded before the timed part (requests:
    server.bench.workload.BenchRequest, their adapters' owners are their tenants). on_start(the
    process), if given, is called once it is healthy (a run that reads the server's CPU time)."""
    from server.bench import client
    from server.bench.workload import tenants_used

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="serve-", dir=work))
    try:
        with ServerProcess(data_dir, work / "logs" / f"serve-{len(named)}-adapters.log", model_dir=model_dir,
                           serve_args=serve_args) as srv:
            if on_start is not None:
                on_start(srv)
            owners = {r.adapter_name: r.tenant for r in requests if r.adapter_name is not None}
            keys, base = provision(srv.url, srv.admin_token, tenants_used(requests),
                                   {name: (owners[name], path) for name, path in named.items()})
            log(f"  server up at {srv.url}, {len(keys)} tenants, {len(named)} adapters uploaded")
            asyncio.run(client.warmup(srv.url, requests, keys, base))
            yield srv.url, keys, base
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
