"""`loraplex serve` answers while it starts (server.starting_responder): from the moment the port is
bound until the engine core is ready, /health is 503 with `"status": "starting"` and any other request
503 with Retry-After (engine_unavailable), then the app serves: /health 200, and the server stops on
SIGTERM with status 0. The port is bound before anything slow, so the first answer is always a 503."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from server.embedded_redis.server import free_port
from tests.fixtures_server import api_redis_url
from tests.repo import ROOT_DIR


def test_health_is_503_until_the_engine_core_is_ready(tiny_model_dir, redis_server, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
           "--data-dir", str(tmp_path / "data"), "--redis-url", api_redis_url(redis_server), "--device", "cpu",
           "--kv-cache-blocks", "64", "--max-model-len", "256", "--engine-process", "separate"]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT_DIR, stdout=out, stderr=subprocess.STDOUT)
    try:
        starting = []  # (the request sent first, /health after it) while /health said 503
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                # A request first: if /health after it still says 503, the server was starting for both.
                asked = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=60)
                health = httpx.get(f"{url}/health", timeout=60)
            except httpx.TransportError:  # not bound yet
                time.sleep(0.05)
                continue
            if health.status_code == 200:
                break
            starting.append((asked, health))
            time.sleep(0.05)
        assert starting, "the first /health answer was 200: the server answered nothing while it started"
        for early, early_health in starting:
            assert early_health.status_code == 503 and early_health.json()["status"] == "starting", early_health.text
            assert early_health.json()["engine"] is False and early_health.headers["retry-after"] == "1"
            assert early.status_code == 503 and early.headers["retry-after"] == "1", early.text
            assert early.json()["error"]["code"] == "engine_unavailable"
        assert health.json()["status"] == "ok"
        assert httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    assert code == 0, log.read_text()
