"""--shutdown-timeout: parsed from the CLI into the config the server stops with, refused out of range
(tests/server/test_cli_start_stop.py checks a running server's stop line names it)."""
from __future__ import annotations

import pytest

from server.cli import build_parser
from server.config import ConfigError, ServerConfig


def _config(tmp_path, *flags: str) -> ServerConfig:
    args = build_parser().parse_args(["serve", "--model", "demo", "--data-dir", str(tmp_path),
                                      "--admin-token", "x" * 16, *flags])
    return ServerConfig.from_args(args, env={})


def test_the_default_is_kubernetes_grace_period_and_a_value_is_kept(tmp_path):
    assert _config(tmp_path).shutdown_timeout == 30.0
    assert _config(tmp_path, "--shutdown-timeout", "2.5").shutdown_timeout == 2.5


@pytest.mark.parametrize("seconds", [-1.0, 3601.0])
def test_out_of_range_is_refused_naming_the_flag(tmp_path, seconds):
    with pytest.raises(ConfigError, match="--shutdown-timeout"):
        ServerConfig(data_dir=tmp_path, admin_token="x" * 16, shutdown_timeout=seconds)
