"""`scripts/serve --model demo` from an empty data dir: it builds the demo model, starts the
embedded Redis, prints an admin token, a demo key and a curl line that works. (The default real
model's start is tests/server/test_default_model.py's.)"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from server.embedded_redis.server import free_port
from tests.repo import ROOT_DIR as ROOT



@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl to run the printed line")
def test_serve_script_prints_a_working_curl_line(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LORAPLEX_ADMIN_TOKEN"}
    proc = subprocess.Popen([str(ROOT / "scripts" / "serve"), "--data-dir", str(tmp_path / "data"),
                             "--port", str(port), "--model", "demo", "--kv-cache-blocks", "64",
                             "--max-model-len", "512"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = []
    try:
        deadline = time.monotonic() + 240
        curl = None
        while curl is None:
            assert time.monotonic() < deadline, "no curl line:\n" + "".join(out)
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "serve exited:\n" + "".join(out)
            out.append(line)
            if line.strip().startswith("curl "):
                curl = line.strip()
        text = "".join(out)
        data = tmp_path / "data"
        token = re.search(r"admin token \(kept in (\S+)\): (\S{16,})", text)
        key = re.search(r"demo tenant API key \(kept in (\S+)\): (lp-[0-9a-f]{16}\.\S+)", text)
        assert token and key, text
        # kept for later starts, readable by the owner only
        for (path, secret) in (token.groups(), key.groups()):
            assert Path(path).parent == data and Path(path).read_text().strip() == secret
            assert Path(path).stat().st_mode & 0o077 == 0
        assert f"127.0.0.1:{port}" in curl
        result = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
        body = json.loads(result.stdout)
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] >= 1
        # the embedded Redis keeps its data under the data dir
        assert (tmp_path / "data" / "redis" / "redis.log").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
