"""A `loraplex serve` command line parsed into its ServerConfig, and a small adapter shape for
engine_config: the config tests' common steps."""
from __future__ import annotations

from adapters.format import ModelShape
from server.cli import build_parser
from server.config import ServerConfig

SMALL_SHAPE = ModelShape(num_layers=1, hidden_size=8, q_size=8, kv_size=8, intermediate_size=8, vocab_size=8)


def serve_config(tmp_path, *flags: str) -> ServerConfig:
    args = build_parser().parse_args(["serve", "--model", "demo", "--data-dir", str(tmp_path),
                                      "--admin-token", "x" * 16, *flags])
    return ServerConfig.from_args(args, env={})
