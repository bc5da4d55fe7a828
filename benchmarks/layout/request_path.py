"""How many product files one chat completion runs through, from the route to the kernels.

A real server (the tiny random model, an embedded Redis, uvicorn in a thread of this process) answers
a tenant's chat completion; a profile hook on every thread records which files of the product
packages had a function called while the measured request ran (after two warm-up requests, so
start-up and first-use paths are not counted). Prints a table by package and writes JSON.

    .venv/bin/python -m benchmarks.layout.request_path [--json out.json]

Issue 40's target is at most ~25 files (nano-vllm: ~10).
"""
from __future__ import annotations

import argparse
import collections
import json
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from server.api.app import create_app
from server.config import ServerConfig
from server.demo import make_base_model
from server.embedded_redis.server import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("server", "adapters", "kernels", "tenants")


class CallRecorder:
    """A profile function: while `active`, counts calls per product file (relative path)."""

    def __init__(self) -> None:
        self.active = False
        self.calls: collections.Counter[str] = collections.Counter()

    def __call__(self, frame, event, arg) -> None:
        if self.active and event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PRODUCT:
                self.calls[str(path.relative_to(ROOT))] += 1


def measure(workdir: Path) -> dict[str, int]:
    model = make_base_model(workdir / "model", "llama")
    redis_server = EmbeddedRedis.start(workdir / "redis")
    admin = secrets.token_hex(16)
    config = ServerConfig.of(data_dir=workdir / "data", admin_token=admin, model=str(model),
                             redis_url=redis_server.url, port=free_port(), device="cpu",
                             kv_cache_blocks=64, max_model_len=512, max_num_seqs=16)
    recorder = CallRecorder()
    threading.setprofile(recorder)  # every thread the server starts from here on
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=config.port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise SystemExit("the server did not start")
            time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{config.port}", timeout=60) as client:
            auth = {"Authorization": f"Bearer {admin}"}
            client.post("/admin/tenants", headers=auth, json={"name": "probe", "quota": {}}).raise_for_status()
            key = client.post("/admin/tenants/probe/keys", headers=auth).json()["key"]
            headers = {"Authorization": f"Bearer {key}"}
            model_id = client.get("/v1/models", headers=headers).json()["data"][0]["id"]
            body = {"model": model_id, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(2):
                client.post("/v1/chat/completions", headers=headers, json=body).raise_for_status()
            sys.setprofile(recorder)
            recorder.active = True
            client.post("/v1/chat/completions", headers=headers, json=body).raise_for_status()
            recorder.active = False
            sys.setprofile(None)
    finally:
        threading.setprofile(None)
        server.should_exit = True
        thread.join(30)
        redis_server.stop()
    return dict(sorted(recorder.calls.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        calls = measure(Path(tmp))
    by_package = collections.Counter(str(Path(f).parent) for f in calls)
    print(f"{'package':28} files")
    for package, n in sorted(by_package.items()):
        print(f"{package:28} {n:5d}")
    print(f"{'total':28} {len(calls):5d}")
    if args.json:
        args.json.write_text(json.dumps({"files": len(calls), "by_package": dict(by_package), "calls": calls},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
