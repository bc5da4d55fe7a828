"""Issue 43's hostile probe, finding 9: operator input. A GPTQ 8-bit or AWQ quantization_config was
refused through a lifespan traceback, and a GPTQ 4-bit config over plain float weights started and
served silently; each is now one `loraplex: error:` line from a real `loraplex serve`, exit status 2.
So is a malformed --lora-modules source (finding 5's URLs at the operator's entry point), which was a
lifespan traceback."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.embedded_redis.server import free_port
from server.engine import LLM
from server.engine.config import ModelConfigError
from tests.repo import ROOT_DIR as ROOT


def _with_quantization(tiny_model_dir: Path, dest: Path, qc: dict) -> Path:
    dest.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, dest / f.name)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return dest


def _serve(tmp_path: Path, model: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LORAPLEX_ADMIN_TOKEN", "PYTHONWARNINGS")}
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", str(free_port()),
           "--data-dir", str(tmp_path / "data"), "--redis-url", "redis://127.0.0.1:9/0", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("qc, says", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "'gptq' (bits 8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "projections are float tensors, not GPTQ"),
])
def test_an_unsupported_quantization_config_is_one_line_at_start(tiny_model_dir, tmp_path, qc, says):
    model = _with_quantization(tiny_model_dir, tmp_path / "model", qc)
    done = _serve(tmp_path, model)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("loraplex: error: --model: ") and says in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_a_float_checkpoint_is_refused_where_gptq_is_asked_for(tiny_model_dir, tmp_path):
    done = _serve(tmp_path, tiny_model_dir, "--quantization", "gptq")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "is not one (no quantization_config)" in done.stderr


def test_the_offline_api_refuses_a_gptq_config_over_float_weights(tiny_model_dir, tmp_path):
    model = _with_quantization(tiny_model_dir, tmp_path / "model", {"quant_method": "gptq", "bits": 4,
                                                                   "group_size": 32})
    with pytest.raises(ModelConfigError, match="not GPTQ"):
        LLM(model, device="cpu", kv_cache_blocks=16, max_model_len=64)


@pytest.mark.parametrize("source", ["http://[::1/a/", "s3://[::1/x", "s3://bucket/a/../b", "https://h:99999/a/"])
def test_a_malformed_lora_modules_source_is_one_line_at_start(tiny_model_dir, tmp_path, source):
    done = _serve(tmp_path, tiny_model_dir, "--lora-modules", f"bad={source}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("loraplex: error: --lora-modules bad: adapter source "), \
        done.stderr
