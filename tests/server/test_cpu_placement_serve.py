"""CPU placement on a real `loraplex serve` (issue 35 item 6, issue 43's compile_flood): with
--engine-cpus 0 --api-cpus 1 the affinity each process and thread ends with, read from
/proc/PID/task/TID/status: in-process, every thread of the server (HTTP and the step loop share one
GIL) on core 0 and its compile and loader processes on core 1; with --engine-process separate, every
thread of the engine-core process on core 0, and its loader process, the front end and its children
on core 1."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from server.bench.server_proc import ServerProcess
from server.engine.core.process import PROCESS_NAME as CORE_PROCESS_NAME
from tests.fixtures_server import api_redis_url
from tests.repo import ROOT_DIR as ROOT

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
                  "--engine-cpus", "0", "--api-cpus", "1", "--model", str(tiny_model_dir),
                  "--adapter-sources", "http"]  # with sources, the loader processes start
    with ServerProcess(tmp_path / "data", tmp_path / "serve.log", model_dir=None, serve_args=serve_args) as srv:
        _constrained_request(srv)
        server = psutil.Process(srv.proc.pid)
        descendants = server.children(recursive=True)
        core = [p for p in descendants if p.name() == CORE_PROCESS_NAME]  # forked by serve: the CLI's cmdline
        threads = _allowed(srv.proc.pid)
        if mode == "in-process":  # HTTP and the step loop share one GIL: they stay together
            assert not core
            assert set(threads.values()) == {"0"}, threads
        else:
            assert len(core) == 1
            assert "server.engine.core" not in core[0].cmdline()  # forked by serve, torch imported once
            assert set(threads.values()) == {"1"}, threads  # the front end
            assert set(_allowed(core[0].pid).values()) == {"0"}, _allowed(core[0].pid)
        front = [p for p in descendants if p not in core]
        # Compiles fork from multiprocessing's fork server (same command line): its children.
        forkservers = [p for p in front if "forkserver" in " ".join(p.cmdline()) and p.ppid() == srv.proc.pid]
        compiles = [c for f in forkservers for c in f.children()]
        assert compiles, [p.cmdline() for p in front]
        loaders = [p for p in front if "spawn_main" in " ".join(p.cmdline())]
        assert len(loaders) >= 2 + (mode == "separate"), [p.cmdline() for p in front]  # the core's pager too
        for proc in front:  # compiles, loaders (the core's too), Redis: all on core 1
            # multiprocessing's idle helpers keep their starter's mask (each compile is moved as it forks)
            if "resource_tracker" in " ".join(proc.cmdline()) or (proc in forkservers and mode == "in-process"):
                continue
            assert set(_allowed(proc.pid).values()) == {"1"}, (proc.cmdline(), _allowed(proc.pid))
    log = (tmp_path / "serve.log").read_text()
    if mode == "separate":
        assert ("cpu placement: engine-core process on cores 0; HTTP front end, grammar compiles, adapter "
                "loaders and Redis on cores 1") in log
    else:
        assert ("cpu placement: server process (HTTP and the engine's step loop, one interpreter) on cores 0; "
                "grammar compiles, adapter loaders and Redis on cores 1") in log


def test_overlapping_lists_are_refused_at_start_in_one_line(tmp_path):
    from server.embedded_redis.server import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("LORAPLEX_ADMIN_TOKEN", "LORAPLEX_REDIS_URL")}
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", "demo", "--port", str(free_port()),
                           "--data-dir", str(tmp_path / "data"), "--engine-cpus", "0", "--api-cpus", "0-1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, lines
    assert lines[0] == ("loraplex: error: --engine-cpus 0 and --api-cpus 0-1 overlap on core(s) 0: give each side "
                        "cores of its own")
