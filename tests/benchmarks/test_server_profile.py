"""The bench's server profiler (benchmarks/profile/server_profile.py): attribution of raw py-spy stacks to
who spent them, and a real py-spy recording of a real process whose threads burn CPU in known places."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.profile.server_profile import Sampler, can_profile, category, summarize

SERVER = 'process 10:"python -m server.cli serve"'


def test_engine_samples_are_named_by_the_phase_of_step_they_were_in():
    frames = [SERVER, "thread (11): loraplex-engine", "Thread.run (threading.py:982)",
              "AsyncEngine._run (/repo/server/engine/async_engine.py:210)", "LLMEngine.step (/repo/server/engine/llm_engine.py:307)",
              "ModelRunner.run (/repo/server/engine/model_runner.py:180)", "forward (/repo/server/engine/model.py:40)"]
    assert category(frames) == "engine: ModelRunner.run"
    assert category(frames[:4]) == "engine: outside step"


def test_loop_and_worker_samples_are_named_by_the_deepest_api_file():
    loop = [SERVER, "thread (10): MainThread", "run (uvicorn/server.py:60)",
            "dispatch (/repo/server/api/response_headers.py:20)", "tokenize (/repo/server/api/tokenize_routes.py:44)",
            "encode (tokenizers/__init__.py:1)"]
    assert category(loop) == "event loop: api/tokenize_routes.py"
    assert category(loop[:3]) == "event loop: framework (uvicorn, starlette, asyncio)"
    worker = [SERVER, "thread (12): asyncio_3", "render (/repo/server/api/openai_routes.py:9)"]
    assert category(worker) == "thread asyncio: api/openai_routes.py"


def test_child_processes_are_named_by_what_they_run():
    child = [SERVER, 'process 20:"python -c from multiprocessing.forkserver import main"',
             "thread (20): MainThread", "_compile (/repo/server/engine/grammar_worker.py:300)"]
    assert category(child) == "child: grammar compile"
    assert category(child[:3] + ["main (/repo/adapters/loader_worker.py:10)"]) == "child: adapter loader"
    assert category(child[:3] + ["spin (x.py:1)"]) == "child: other"


def test_engine_core_samples_are_named_by_the_part_of_the_step_loop_or_their_thread():
    core = [SERVER, 'process 30:"python -m server.cli serve"']
    step = core + ["thread (30): MainThread", "EngineCore.run (/repo/server/engine/core/busy_loop.py:45)",
                   "LLMEngine.step (/repo/server/engine/llm_engine.py:221)",
                   "LLMEngine.step_plain (/repo/server/engine/llm_engine.py:225)"]
    assert category(step + ["Scheduler.schedule (/repo/server/engine/scheduler.py:500)"], 30) == \
        "engine core: Scheduler.schedule"
    assert category(step + ["Scheduler.schedule (/repo/server/engine/scheduler.py:500)",
                            "Scheduler._acquire_slot (/repo/server/engine/scheduler.py:663)"], 30) == \
        "engine core: slot load (Scheduler._acquire_slot)"
    assert category(step[:4] + ["LLMEngine.stats (/repo/server/engine/llm_engine.py:260)"], 30) == \
        "engine core: LLMEngine.stats (snapshot between steps)"
    assert category(step[:4], 30) == "engine core: outside step"
    page_in = core + ["thread (31): adapter-load_1", "send (/repo/adapters/loader_worker.py:35)"]
    assert category(page_in, 30) == "engine core: thread adapter-load"
    assert category(page_in) == "child: adapter loader"  # without its pid: any child running the loader's code


@pytest.mark.skipif(can_profile() is not None, reason=f"cannot profile here: {can_profile()}")
def test_a_recording_of_a_real_process_attributes_its_burning_threads(tmp_path: Path):
    api = tmp_path / "server" / "api"
    api.mkdir(parents=True)
    (api / "routes.py").write_text(textwrap.dedent("""
        import time
        def handle(seconds):
            end = time.time() + seconds
            while time.time() < end:
                sum(range(500))
    """))
    (tmp_path / "target.py").write_text(textwrap.dedent("""
        import threading, time
        from server.api.routes import handle  # tmp_path's server/, beside this script

        class LLMEngine:
            def step(self):
                burn_forward(6)

        def burn_forward(seconds):
            handle(seconds)

        engine = threading.Thread(target=LLMEngine().step, name="loraplex-engine")
        engine.start()
        handle(6)
        engine.join()
    """))
    # without PYTHONPATH: a checkout's server/ on it would shadow tmp_path's
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "target.py")], env=env)
    try:
        time.sleep(1.0)
        out = tmp_path / "phase.txt"
        start = time.perf_counter()
        with Sampler(proc.pid, out, rate=50) as sampler:
            time.sleep(2.0)
        summary = summarize(out, time.perf_counter() - start, sampler.rate)
    finally:
        proc.kill()
        proc.wait()
    shares = {row["category"]: row["share"] for row in summary["by_category"]}
    assert summary["samples"] > 20, summary
    # Both threads burn all the time but share one GIL: each holds a large part of the samples.
    assert shares.get("engine: burn_forward", 0) > 0.2, shares
    assert shares.get("event loop: api/routes.py", 0) > 0.2, shares
    assert 0 < summary["cpu_cores"] <= 2.5, summary
