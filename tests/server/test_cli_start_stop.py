"""A new operator's first start and stop (issue 25): every `serve` flag documents its default; a real
`loraplex serve` subprocess says who can call each --adapter and where the console and docs are, prints
no warning or progress bar on the way up, and stops on SIGINT or SIGTERM with one line, no traceback and
exit status 0."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.cli import build_parser
from server.config import ConfigError, parse_adapter_flag
from server.embedded_redis.server import free_port
from tests.repo import ROOT_DIR as ROOT

# What a library's noise looks like on stderr: warnings, tqdm bars, tracebacks.
NOISE = re.compile(r"Warning|warnings\.warn|it/s\]|\d+%\||Traceback")


def _serve_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["serve"]


def test_every_serve_flag_has_help_with_its_default():
    missing = [a.option_strings[0] for a in _serve_parser()._actions
               if a.option_strings and a.dest != "help" and "default" not in (a.help or "").lower()]
    assert missing == []


def test_adapter_flag_takes_an_owner():
    assert parse_adapter_flag("acme/sql=/a/b") == ("acme", "sql", "/a/b")
    assert parse_adapter_flag("sql=/a=b") == (None, "sql", "/a=b")
    for bad in ("Acme/sql=/a", "sql", "a/b/c=/d", "/sql=/a"):
        with pytest.raises(ConfigError):
            parse_adapter_flag(bad)


def _start(tmp_path: Path, port: int, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    out, err = tmp_path / f"out-{port}.txt", tmp_path / f"err-{port}.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("LORAPLEX_ADMIN_TOKEN", "PYTHONWARNINGS")}
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", "demo", "--port", str(port),
           "--data-dir", str(tmp_path / "data"), "--kv-cache-blocks", "64", "--max-model-len", "256", *args]
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=o, stderr=e)
    deadline = time.monotonic() + 240
    while "stop: Ctrl-C" not in out.read_text():
        assert proc.poll() is None, f"serve exited:\n{out.read_text()}\n{err.read_text()}"
        assert time.monotonic() < deadline, f"no banner:\n{out.read_text()}\n{err.read_text()}"
        time.sleep(0.2)
    return proc, out, err


def _stop(proc: subprocess.Popen, sig: int) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_first_start_and_stop(tmp_path):
    """The demo's adapters double as --adapter directories once the first start has built them."""
    port = free_port()
    proc, out, err = _start(tmp_path, port)
    assert _stop(proc, signal.SIGINT) == 0
    first_err = err.read_text()
    assert "SIGINT received: stopping (running requests get 30 s;" in first_err, first_err
    assert "building the demo model" in first_err and not NOISE.search(first_err), first_err
    assert not NOISE.search(out.read_text())

    adapters = tmp_path / "data" / "demo" / "adapters"
    port = free_port()
    proc, out, err = _start(tmp_path, port, "--adapter", f"mine={adapters / 'demo-r4'}",
                            "--adapter", f"acme/theirs={adapters / 'demo-r8'}", "--shutdown-timeout", "7.5")
    try:
        banner = out.read_text()
        base = f"http://127.0.0.1:{port}"
        assert f"console: {base}/admin/ui" in banner and f"API docs: {base}/docs" in banner
        assert 'adapter mine (--adapter, tenant demo): send "model": "mine" with the demo key' in banner
        assert "adapter theirs (--adapter, tenant acme)" in banner and "/admin/tenants/acme/keys" in banner
        key = re.search(r"demo tenant API key \(kept in \S+\): (\S+)", banner).group(1)
        admin = re.search(r"admin token \(kept in \S+\): (\S+)", banner).group(1)
        body = {"prompt": "hi", "max_tokens": 2}
        demo = {"Authorization": f"Bearer {key}"}
        assert httpx.post(f"{base}/v1/completions", json={**body, "model": "mine"}, headers=demo).status_code == 200
        # acme's adapter is acme's alone: the demo key does not see it, a key of acme does
        assert httpx.post(f"{base}/v1/completions", json={**body, "model": "theirs"}, headers=demo).status_code == 404
        r = httpx.post(f"{base}/admin/tenants/acme/keys", headers={"Authorization": f"Bearer {admin}"})
        acme = {"Authorization": f"Bearer {r.json()['key']}"}
        assert httpx.post(f"{base}/v1/completions", json={**body, "model": "theirs"}, headers=acme).status_code == 200
    finally:
        status = _stop(proc, signal.SIGTERM)
    stderr = err.read_text()
    assert status == 0 and not NOISE.search(stderr) and not NOISE.search(out.read_text()), stderr
    assert stderr.count("SIGTERM received: stopping (running requests get 7.5 s;") == 1
    # one line per start stage: each of loraplex's own (the server's or its engine core's), nothing from
    # uvicorn's lifecycle
    assert all(line.startswith(("loraplex: ", "loraplex engine core: ")) for line in stderr.splitlines()), stderr
