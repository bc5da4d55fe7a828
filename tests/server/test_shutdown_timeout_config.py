"""--shutdown-timeout: parsed from the CLI into the config the server stops with, refused out of range
(tests/server/test_cli_start_stop.py checks a running server's stop line names it)."""
from __future__ import annotations

import pytest

from server.config import ConfigError, ServerConfig
from tests.server.serve_config import serve_config


def test_the_default_is_kubernetes_grace_period_and_a_value_is_kept(tmp_path):
    assert serve_config(tmp_path).shutdown_timeout == 30.0
    assert serve_config(tmp_path, "--shutdown-timeout", "2.5").shutdown_timeout == 2.5


@pytest.mark.parametrize("seconds", [-1.0, 3601.0])
def test_out_of_range_is_refused_naming_the_flag(tmp_path, seconds):
    with pytest.raises(ConfigError, match="--shutdown-timeout"):
        ServerConfig(data_dir=tmp_path, admin_token="x" * 16, shutdown_timeout=seconds)
