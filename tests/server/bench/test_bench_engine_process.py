"""The bench's --engine-process: the HTTP server's engine mode, the server's default unless given."""
from __future__ import annotations

import pytest

from benchmarks.serving.bench import build_parser
from server.bench.cli import config_from_args
from server.bench.model_setup import serve_args
from server.bench.runner import BenchConfig, BenchConfigError
from server.config import ServerConfig

pytestmark = pytest.mark.unit


def test_default_is_the_servers_own_and_reaches_the_serve_flags():
    cfg = config_from_args(build_parser().parse_args([]))
    assert cfg.engine_process == ServerConfig.engine_process
    args = serve_args(cfg, 2)
    assert args[args.index("--engine-process") + 1] == ServerConfig.engine_process


def test_in_process_reaches_the_serve_flags():
    cfg = config_from_args(build_parser().parse_args(["--engine-process", "in-process"]))
    args = serve_args(cfg, 2)
    assert args[args.index("--engine-process") + 1] == "in-process"


def test_refused_for_the_engine_target_and_unknown_modes():
    with pytest.raises(BenchConfigError, match="--engine-process"):
        BenchConfig(target="engine", engine_process="separate")
    with pytest.raises(BenchConfigError, match="--engine-process"):
        BenchConfig(engine_process="threads")
    assert BenchConfig(target="engine").engine_process is None
