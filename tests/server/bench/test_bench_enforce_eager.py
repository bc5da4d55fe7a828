"""--enforce-eager reaches the engine the bench builds and the `loraplex serve` it starts (today's H200
run's steady JSON said engine_has_enforce_eager: false: the flag was dropped by a stale feature check)."""
from __future__ import annotations

import pytest

from server.bench.runner import BenchConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("eager", [True, False])
def test_enforce_eager_reaches_the_engine_config_and_the_serve_argv(eager, tiny_model_dir, tmp_path):
    from server.bench.model_setup import engine_kwargs, serve_args
    from server.bench.prefix import _engine_kwargs
    from server.cli import build_parser
    from server.config import ServerConfig
    from server.engine.config import EngineConfig

    cfg = BenchConfig(enforce_eager=eager)
    assert EngineConfig.of(model="m", **engine_kwargs(cfg, tiny_model_dir, 2)).device.enforce_eager is eager
    assert EngineConfig.of(model="m", **_engine_kwargs(cfg, 2)).device.enforce_eager is eager
    argv = serve_args(cfg, 2)
    assert ("--enforce-eager" in argv) is eager
    args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), "--admin-token", "x" * 16, *argv])
    assert ServerConfig.from_args(args, env={}).engine.device.enforce_eager is eager
