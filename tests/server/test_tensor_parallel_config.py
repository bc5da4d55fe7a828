"""--tensor-parallel-size: parsed from the CLI, passed to the engine, refused below 1 naming the flag."""
from __future__ import annotations

import pytest

from server.config import ConfigError
from server.engine_settings import engine_config
from tests.server.serve_config import SMALL_SHAPE, serve_config

pytestmark = pytest.mark.unit


def test_flag_reaches_the_engine(tmp_path):
    config = serve_config(tmp_path, "--tensor-parallel-size", "2")
    assert engine_config(config, "demo", SMALL_SHAPE).tensor_parallel_size == 2
    assert engine_config(serve_config(tmp_path), "demo", SMALL_SHAPE).tensor_parallel_size == 1


def test_below_one_refused_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be >= 1"):
        serve_config(tmp_path, "--tensor-parallel-size", "0")
