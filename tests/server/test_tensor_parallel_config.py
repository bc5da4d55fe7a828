"""--tensor-parallel-size: parsed from the CLI, passed to the engine, refused below 1 naming the flag."""
from __future__ import annotations

import pytest

from adapters.format import ModelShape
from server.cli import build_parser
from server.config import ConfigError, ServerConfig
from server.engine_settings import engine_config

pytestmark = pytest.mark.unit


def _config(tmp_path, *flags: str) -> ServerConfig:
    args = build_parser().parse_args(["serve", "--model", "demo", "--data-dir", str(tmp_path),
                                      "--admin-token", "x" * 16, *flags])
    return ServerConfig.from_args(args, env={})


def test_flag_reaches_the_engine(tmp_path):
    shape = ModelShape(num_layers=1, hidden_size=8, q_size=8, kv_size=8, intermediate_size=8, vocab_size=8)
    assert engine_config(_config(tmp_path, "--tensor-parallel-size", "2"), "demo", shape).tensor_parallel_size == 2
    assert engine_config(_config(tmp_path), "demo", shape).tensor_parallel_size == 1


def test_below_one_refused_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be >= 1"):
        _config(tmp_path, "--tensor-parallel-size", "0")
