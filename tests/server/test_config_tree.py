"""ServerConfig holds the engine's config tree: `serve`'s flags build it once (units converted there), its
refusals name the flags, the CLI keeps its documented defaults, and parsing configs loads no torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from server.config import ConfigError, ServerConfig
from server.engine.config import EngineConfig
from tests.repo import ROOT_DIR
from tests.server.serve_config import serve_config

pytestmark = pytest.mark.unit


def test_config_modules_import_without_torch():
    code = ("import sys, server.config, server.engine.config as c; c.EngineConfig.of('m', max_loras=2); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT_DIR, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_cli_keeps_its_defaults_and_the_python_api_its_own(tmp_path):
    engine = serve_config(tmp_path).engine
    assert (engine.lora.max_loras, engine.lora.max_cpu_lora_bytes) == (8, 1 << 30)
    assert engine.scheduler.max_prefill_tokens_while_decoding == "auto"
    in_code = ServerConfig(data_dir=tmp_path, admin_token="x" * 16).engine  # docs/cli.md's defaults there too
    assert in_code == EngineConfig.of(max_loras=8, max_cpu_lora_bytes=1 << 30,
                                      max_prefill_tokens_while_decoding="auto")
    api = EngineConfig.of("m")
    assert (api.lora.max_loras, api.lora.max_cpu_lora_bytes, api.scheduler.max_prefill_tokens_while_decoding) == (
        None, None, None)


def test_units_convert_at_the_boundary(tmp_path):
    engine = serve_config(tmp_path, "--max-grammar-mask-ms", "250", "--max-cpu-loras", "3",
                          "--max-loras", "auto", "--max-prefill-tokens-while-decoding", "off").engine
    assert engine.scheduler.max_mask_fill_seconds == 0.25
    assert (engine.lora.max_cpu_loras, engine.lora.max_cpu_lora_bytes, engine.lora.max_loras) == (3, None, None)
    assert engine.scheduler.max_prefill_tokens_while_decoding is None
    assert serve_config(tmp_path, "--engine-process", "separate").engine_for("/m").model == "/m"


@pytest.mark.parametrize("flags, line", [
    (("--max-lora-rank", "1024"), "--max-lora-rank must be at most 512, got 1024"),
    (("--max-grammar-mask-seconds", "0"), "--max-grammar-mask-seconds must be > 0"),
    (("--quantize-lm-head",), "--quantize-lm-head needs --quantization 'int8'"),
    (("--kv-cache-dtype", "int8"), "--kv-cache-dtype 'int8' is not supported"),
    (("--async-scheduling", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'),
     "--speculative-config does not combine with --async-scheduling"),
])
def test_engine_refusals_name_the_flag(tmp_path, flags, line):
    with pytest.raises(ConfigError, match=line):
        serve_config(tmp_path, *flags)


def test_flat_settings_for_tests_and_code(tmp_path):
    config = ServerConfig.of(data_dir=tmp_path, admin_token="x" * 16, port=9000, max_loras=2, device="cpu")
    assert (config.port, config.engine.lora.max_loras, config.engine.device.device) == (9000, 2, "cpu")
    assert config.engine.lora.max_cpu_lora_bytes == 1 << 30  # the CLI's default under what was given
    assert config.with_settings(max_loras=3, port=9001).engine.lora.max_loras == 3
    counted = config.with_settings(max_cpu_loras=8).engine.lora  # the count in place of the default bytes
    assert (counted.max_cpu_loras, counted.max_cpu_lora_bytes) == (8, None)
    with pytest.raises(ConfigError, match="unknown engine setting"):
        ServerConfig.of(data_dir=tmp_path, admin_token="x" * 16, max_lorras=2)
