"""The core fork server (server.engine.core.fork_server): a core forked from it gets its launch as
msgpack bytes, reports its exit status, and does not import the caller's main module again (a user's
unguarded script); FrontEndWatch sees the front end exit whoever the core's parent is. Served cores
from it end to end (kill -9 included): tests/server/api/test_api_engine_process.py, _restart.py."""
from __future__ import annotations

import subprocess
import sys

from server.engine.core.front_end_watch import FrontEndWatch
from tests.repo import ROOT_DIR

# No `if __name__ == "__main__"` guard, on purpose: a child that re-imported it would print twice.
SCRIPT = """
import os
from server.engine.core.fork_server import CoreForkServer

print("main", os.getpid(), flush=True)
server = CoreForkServer()
first = server.start(b"not a launch")
second = server.start(b"\\x01")
print("codes", first.wait(120), second.wait(120), first.poll(), first.pid != second.pid != os.getpid())
"""


def test_a_forked_core_reports_its_status_and_leaves_the_main_module_alone():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT_DIR, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len([line for line in lines if line.startswith("main ")]) == 1, lines
    assert lines[-1] == "codes 1 1 1 True", lines
    assert done.stderr.count("Traceback") == 2, done.stderr  # each core said why it could not start


def test_front_end_watch_sees_the_process_exit():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = FrontEndWatch(proc.pid)
        assert not watch.gone()
        proc.kill()
        proc.wait()
        assert watch.gone()
    finally:
        proc.kill()


# Each core refuses its launch as it starts (tensor parallel on a CPU), so it exits 1 quickly.
BOUND_SCRIPT = """
import json, os, sys
from pathlib import Path
import psutil
from adapters.format import ModelShape
from server.engine.config import EngineConfig
from server.engine.core.launch import CoreLaunch
from server.engine.core.launcher import CoreStarter

model = Path(sys.argv[1])
launch = CoreLaunch(
    EngineConfig.of(model=str(model), device="cpu", kv_cache_blocks=64, max_model_len=512, tensor_parallel_size=2,
                    fully_sharded_loras=True, lora_page_rows=16),
    input_address="ipc://" + sys.argv[2], parent_pid=os.getpid(), redis_url="redis://127.0.0.1:1",
    redis_prefix="lp-bound:", adapter_grace_seconds=600.0,
    adapter_shape=ModelShape.from_hf_config(json.loads((model / "config.json").read_text())),
    pager=False, max_upload_bytes=1 << 20)
me = psutil.Process()

def fork_servers():
    return [c for c in me.children() if "forkserver" in " ".join(c.cmdline())]

starter = CoreStarter()
for i in range(4):
    os.environ["LORAPLEX_BOUND_TEST"] = str(i)  # a new environment: a new fork server
    code = starter.start(launch).wait(240)
    print("round", i, code, starter.fork_servers, len(fork_servers()), me.num_fds(), flush=True)
starter.close()
zombies = [c.pid for c in me.children(recursive=True) if c.status() == psutil.STATUS_ZOMBIE]
print("closed", starter.fork_servers, len(fork_servers()), zombies, me.num_fds())
"""


def test_a_starter_holds_one_idle_fork_server_whatever_environments_it_saw(tiny_model_dir, tmp_path):
    done = subprocess.run([sys.executable, "-c", BOUND_SCRIPT, str(tiny_model_dir), str(tmp_path / "in")],
                          cwd=ROOT_DIR, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rounds = [line.split() for line in done.stdout.splitlines() if line.startswith("round ")]
    assert [r[2:5] for r in rounds] == [["1", "1", "1"]] * 4, rounds  # each core failed; one fork server held
    fds = [int(r[5]) for r in rounds]
    assert fds[1:] == [fds[0]] * 3, fds  # a closed fork server leaves no descriptor behind
    closed = done.stdout.splitlines()[-1].split()
    assert closed[:4] == ["closed", "0", "0", "[]"], closed  # reaped: no fork server, no zombie
    assert int(closed[4]) < fds[0], closed
