"""CPU placement on a real `loraplex serve` (issue 35 item 6, issue 43's compile_flood): with
--engine-cpus 0 --api-cpus 1 the affinity each process and thread ends with, read from
/proc/PID/task/TID/status: in-process, the step-loop thread on core 0 and every other thread of the
server, its compile and loader processes on core 1; with --engine-process separate, every thread of
the engine-core process on core 0 and its loader process, the server and its children on core 1."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import psutil
import pytest

from server.bench.server_proc import ServerProcess
from tests.fixtures_server import api_redis_url

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not {0, 1} <= os.sched_getaffinity(0),
                                reason="needs Linux and cores 0 and 1")


def _allowed(pid: int) -> dict[int, str]:
    """Each thread of `pid`: its Cpus_allowed_list."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split(":", 1)[1].strip()
    return out


def _constrained_request(srv: ServerProcess) -> None:
    """A tenant's guided_choice request: the compile pool starts its processes."""
    admin = {"Authorization": f"Bearer {srv.admin_token}"}
    assert httpx.post(f"{srv.url}/admin/tenants", headers=admin, json={"name": "p", "quota": {}}).status_code == 201
    key = httpx.post(f"{srv.url}/admin/tenants/p/keys", headers=admin).json()["key"]
    auth = {"Authorization": f"Bearer {key}"}
    model = httpx.get(f"{srv.url}/v1/models", headers=auth).json()["data"][0]["id"]
    r = httpx.post(f"{srv.url}/v1/completions", headers=auth, timeout=300, json={
        "model": model, "prompt": "x", "max_tokens": 2, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("mode", ["in-process", "separate"])
def test_each_process_ends_on_its_sides_cores(mode, redis_server, tiny_model_dir, tmp_path):
    serve_args = ["--redis-url", api_redis_url(redis_server), "--device", "cpu", "--engine-process", mode,
                  "--engine-cpus", "0", "--api-cpus", "1", "--model", str(tiny_model_dir)]
    with ServerProcess(tmp_path / "data", tmp_path / "serve.log", model_dir=None, serve_args=serve_args) as srv:
        _constrained_request(srv)
        server = psutil.Process(srv.proc.pid)
        descendants = server.children(recursive=True)
        core = [p for p in descendants if "server.engine.core" in " ".join(p.cmdline())]
        threads = _allowed(srv.proc.pid)
        if mode == "in-process":
            assert not core
            assert threads[srv.proc.pid] == "1"  # the main thread: HTTP's event loop
            step = [tid for tid, cores in threads.items() if cores == "0"]
            assert step, threads  # the step loop (and any thread it started)
            assert set(threads.values()) == {"0", "1"}, threads
        else:
            assert len(core) == 1
            assert set(threads.values()) == {"1"}, threads
            assert set(_allowed(core[0].pid).values()) == {"0"}, _allowed(core[0].pid)
        front = [p for p in descendants if p not in core]
        assert front, "the compile and loader processes"
        assert any("forkserver" in " ".join(p.cmdline()) or "multiprocessing" in " ".join(p.cmdline())
                   for p in front)
        for proc in front:  # compile fork server and its compiles, loaders (the core's too), all on core 1
            assert set(_allowed(proc.pid).values()) == {"1"}, (proc.cmdline(), _allowed(proc.pid))
    log = (tmp_path / "serve.log").read_text()
    engine_side = "engine-core process" if mode == "separate" else "engine step loop"
    assert (f"cpu placement: {engine_side} on cores 0; HTTP front end, grammar compiles and adapter loaders "
            f"on cores 1") in log
