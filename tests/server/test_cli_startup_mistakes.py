"""Start-up mistakes are one line (issue 42, item 6): the real `loraplex serve` in a subprocess exits
non-zero with exactly one line on stderr, naming the flag and the fix, no traceback, and (none of these
needs the model) within seconds of its start: the issue asks 2 s; this asserts 5 s, for the busy
shared machine, and the measured times are in the test names' report (`-s`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from server.cli import build_parser
from server.embedded_redis.binary import RECORD_NAME, probe
from server.embedded_redis.server import EmbeddedRedis, find_redis_server, free_port
from tests.repo import ROOT_DIR as ROOT

LIMIT_S = 5.0


def _serve(data_dir: Path, *args: str) -> tuple[int, list[str], float]:
    env = {k: v for k, v in os.environ.items() if k not in ("LORAPLEX_ADMIN_TOKEN", "LORAPLEX_REDIS_URL")}
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", "demo", "--port", str(free_port()),
           "--data-dir", str(data_dir), *args]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    print(f"{args[:2]}: {elapsed:.2f} s")
    return done.returncode, done.stderr.splitlines(), elapsed


def _refused(data_dir: Path, *args: str) -> str:
    code, lines, elapsed = _serve(data_dir, *args)
    assert code != 0 and len(lines) == 1, lines
    assert elapsed < LIMIT_S, elapsed
    assert lines[0].startswith("loraplex: error: ") and "Traceback" not in lines[0]
    return lines[0]


def test_a_missing_lora_modules_path(tmp_path):
    line = _refused(tmp_path / "data", "--lora-modules", f"sql={tmp_path / 'nowhere'}")
    assert f"--lora-modules sql: {tmp_path / 'nowhere'} does not exist; give the path of a PEFT adapter" in line


def test_an_adapter_rank_above_the_limit(tmp_path):
    adapter = tmp_path / "big"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                             "rank_pattern": {"q_proj": 128}}))
    line = _refused(tmp_path / "data", "--lora-modules", f"big={adapter}")
    assert f"--lora-modules big: {adapter} has rank 128, above --max-lora-rank 64; raise --max-lora-rank" in line
    line = _refused(tmp_path / "data", "--adapter", f"acme/big={adapter}", "--max-lora-rank", "16")
    assert "--adapter big" in line and "above --max-lora-rank 16" in line


def test_max_lora_rank_above_512_and_its_bound_in_help(tmp_path):
    line = _refused(tmp_path / "data", "--max-lora-rank", "1024")
    assert line == "loraplex: error: --max-lora-rank must be at most 512, got 1024: pass --max-lora-rank 512 or less"
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    helps = {a.option_strings[0]: a.help for a in serve._actions if a.option_strings}
    assert "1..512" in helps["--max-lora-rank"] and "1..65536" in helps["--max-num-batched-tokens"]


def test_a_flag_argparse_refuses_is_one_line_too(tmp_path):
    line = _serve(tmp_path / "data", "--max-loras", "0")[1]
    assert line == ["loraplex serve: error: argument --max-loras: expected an integer >= 1, got 0 "
                    "(see `loraplex serve --help`)"]


def test_a_data_dir_another_server_holds(tmp_path):
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k not in ("LORAPLEX_ADMIN_TOKEN", "LORAPLEX_REDIS_URL")}
    first = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", "demo", "--port",
                              str(free_port()), "--data-dir", str(data)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (data / "serve.lock").exists() or (data / "serve.lock").read_text().strip() != str(first.pid):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        line = _refused(data)
        assert line == (f"loraplex: error: --data-dir {data} is in use by another loraplex serve (pid {first.pid}, "
                        f"see {data / 'serve.lock'}): stop it, or pass another --data-dir")
    finally:
        first.kill()
        first.wait(30)


def test_a_data_dir_written_by_a_newer_redis_that_is_gone(tmp_path):
    """The venv-activation case: the recorded 7.0 binary is gone and the one at hand is older."""
    real = find_redis_server()
    if (probe(real).release or (0, 0)) >= (7, 0):
        pytest.skip(f"the redis-server at hand ({real}) is not older than 7.0.15")
    redis_dir = tmp_path / "data" / "redis"
    with EmbeddedRedis.start(redis_dir) as server:
        redis.Redis.from_url(server.url).set("tenant", "acme")
    aof = (redis_dir / "appendonly.aof").read_bytes()
    assert b"acme" in aof
    gone = tmp_path / "uninstalled" / "redis-server"
    (redis_dir / RECORD_NAME).write_text(json.dumps({"path": str(gone), "version": "7.0.15",
                                                     "layout": "appendonly.aof"}))
    line = _refused(tmp_path / "data")
    assert f"was written by redis-server 7.0.15 at {gone} (which is gone)" in line, line
    assert f"at {real} is older and may not read it" in line and "--redis-url" in line, line
    assert (redis_dir / "appendonly.aof").read_bytes() == aof  # nothing started over it


def test_a_data_dir_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = _refused(blocker / "data")
    assert line.startswith(f"loraplex: error: --data-dir {blocker / 'data'}: cannot write there (") and \
        line.endswith("pass a directory this user can write"), line


def test_flags_the_engine_does_not_combine_are_one_line_before_the_engine_core(tmp_path):
    """Checked against the model once it is prepared (no time bound: the demo model is built first); the
    engine core's own refusal had been its traceback and the lifespan's."""
    code, lines, _ = _serve(tmp_path / "data", "--tensor-parallel-size", "2", "--fully-sharded-loras",
                            "--lora-page-rows", "16")
    errors = [line for line in lines if not line.startswith("loraplex: ") or "error" in line]
    assert code != 0 and errors == ["loraplex: error: --fully-sharded-loras does not combine with "
                                    "--lora-page-rows yet"], lines
