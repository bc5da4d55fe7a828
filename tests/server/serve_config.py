"""A `loraplex serve` command line parsed into its ServerConfig: the config tests' common step."""
from __future__ import annotations

from server.cli import build_parser
from server.config import ServerConfig


def serve_config(tmp_path, *flags: str) -> ServerConfig:
    args = build_parser().parse_args(["serve", "--model", "demo", "--data-dir", str(tmp_path),
                                      "--admin-token", "x" * 16, *flags])
    return ServerConfig.from_args(args, env={})
