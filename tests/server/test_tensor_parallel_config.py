"""--tensor-parallel-size and --fully-sharded-loras: parsed from the CLI, passed to the engine, refused when
invalid naming the flag."""
from __future__ import annotations

import pytest

from server.config import ConfigError
from tests.server.serve_config import serve_config

pytestmark = pytest.mark.unit


def test_flag_reaches_the_engine(tmp_path):
    config = serve_config(tmp_path, "--tensor-parallel-size", "2")
    assert config.engine_for("demo").parallel.tensor_parallel_size == 2
    assert serve_config(tmp_path).engine_for("demo").parallel.tensor_parallel_size == 1


@pytest.mark.parametrize("flags, line", [
    (("--tensor-parallel-size", "0"), "--tensor-parallel-size must be >= 1"),
    (("--fully-sharded-loras",), "--fully-sharded-loras needs --tensor-parallel-size > 1"),
])
def test_invalid_values_refused_naming_the_flag(tmp_path, flags, line):
    with pytest.raises(ConfigError, match=line):
        serve_config(tmp_path, *flags)


def test_fully_sharded_loras_reaches_the_engine(tmp_path):
    config = serve_config(tmp_path, "--tensor-parallel-size", "2", "--fully-sharded-loras")
    assert config.engine_for("demo").parallel.fully_sharded_loras
