"""--lora-page-rows, --unified-memory, --pin-adapter and --max-pinned-adapters-per-tenant: parsed from the
CLI, passed to the engine, refused when invalid (naming the flag)."""
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


def test_flags_reach_the_engine(tmp_path):
    config = _config(tmp_path, "--max-lora-rank", "128", "--lora-page-rows", "8", "--pin-adapter", "acme/sql",
                     "--pin-adapter", "chat", "--max-pinned-adapters-per-tenant", "2")
    assert config.pin_adapters == (("acme", "sql"), (None, "chat"))
    shape = ModelShape(num_layers=1, hidden_size=8, q_size=8, kv_size=8, intermediate_size=8, vocab_size=8)
    engine = engine_config(config, "demo", shape)
    assert engine.lora_page_rows == 8 and engine.max_pinned_adapters_per_tenant == 2
    assert _config(tmp_path).lora_page_rows is None  # off by default: slots
    unified = _config(tmp_path, "--lora-page-rows", "8", "--unified-memory")
    assert engine_config(unified, "demo", shape).unified_memory and not engine.unified_memory


@pytest.mark.parametrize("flags, names", [
    (("--lora-page-rows", "12"), "--lora-page-rows"),  # not a power of two
    (("--max-lora-rank", "8", "--lora-page-rows", "16"), "--lora-page-rows"),  # does not divide the max rank
    (("--pin-adapter", "a", "--pin-adapter", "b", "--max-pinned-adapters-per-tenant", "1"),
     "--max-pinned-adapters-per-tenant"),
    (("--pin-adapter", "Bad Tenant/x"), "--pin-adapter"),
    (("--unified-memory",), "--unified-memory needs --lora-page-rows"),
])
def test_invalid_values_are_refused_naming_the_flag(tmp_path, flags, names):
    with pytest.raises(ConfigError, match=names):
        _config(tmp_path, *flags)
