"""--max-prefill-tokens-while-decoding: parsed from the CLI, resolved per device (as the engine starts),
refused when invalid; the Python API's default stays off."""
from __future__ import annotations

import pytest

from server.cli import build_parser
from server.config import ConfigError, ServerConfig
from server.engine.config import CPU_PREFILL_CAP, CPU_PREFILL_STEP_RATIO, EngineConfig
from tests.server.serve_config import serve_config

pytestmark = pytest.mark.unit


def test_auto_caps_a_cpu_and_not_a_gpu(tmp_path):
    config = serve_config(tmp_path).engine.scheduler
    assert config.prefill_cap_for("cpu") == CPU_PREFILL_CAP
    assert config.prefill_cap_for("cuda") is None
    resolved = serve_config(tmp_path).engine_for("m").resolved_for("cpu").scheduler
    assert (resolved.max_prefill_tokens_while_decoding, resolved.max_prefill_step_ratio) == (
        CPU_PREFILL_CAP, CPU_PREFILL_STEP_RATIO)


def test_the_python_api_default_is_off():
    resolved = EngineConfig.of("m").resolved_for("cpu").scheduler
    assert (resolved.max_prefill_tokens_while_decoding, resolved.max_prefill_step_ratio) == (None, None)


def test_auto_bounds_a_cpu_step_by_measured_step_times_and_an_explicit_value_does_not(tmp_path):
    assert serve_config(tmp_path).engine.scheduler.prefill_step_ratio_for("cpu") == CPU_PREFILL_STEP_RATIO
    assert serve_config(tmp_path).engine.scheduler.prefill_step_ratio_for("cuda") is None
    for flag in ("off", "512"):
        config = serve_config(tmp_path, "--max-prefill-tokens-while-decoding", flag).engine.scheduler
        assert config.prefill_step_ratio_for("cpu") is None


@pytest.mark.parametrize("flag, cap", [("off", None), ("512", 512)])
def test_an_explicit_value_holds_on_every_device(tmp_path, flag, cap):
    config = serve_config(tmp_path, "--max-prefill-tokens-while-decoding", flag).engine.scheduler
    assert config.prefill_cap_for("cpu") == cap and config.prefill_cap_for("cuda") == cap


@pytest.mark.parametrize("flag", ["0", "-3", "lots"])
def test_bad_values_are_refused(flag):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-prefill-tokens-while-decoding", flag])


def test_the_config_refuses_what_the_parser_would(tmp_path):
    with pytest.raises(ConfigError, match="--max-prefill-tokens-while-decoding"):
        ServerConfig.of(data_dir=tmp_path, admin_token="x" * 16, max_prefill_tokens_while_decoding=0)
