"""--engine-restart / --engine-restart-limit: parsed into the config the engine client's restart policy
is built from, the limit refused below 1, both refused without an engine-core process (the restarts themselves: tests/server/api/test_api_engine_restart.py)."""
from __future__ import annotations

import pytest

from server.config import ConfigError, ServerConfig
from tests.server.serve_config import serve_config

pytestmark = pytest.mark.unit


def test_restart_is_on_with_a_limit_of_3_by_default_and_flags_are_kept(tmp_path):
    default = serve_config(tmp_path)
    assert (default.engine_restart, default.engine_restart_limit) == (True, 3)
    chosen = serve_config(tmp_path, "--engine-process", "separate", "--no-engine-restart", "--engine-restart-limit", "5")
    assert (chosen.engine_restart, chosen.engine_restart_limit) == (False, 5)


@pytest.mark.parametrize("flags", [["--no-engine-restart"], ["--engine-restart"], ["--engine-restart-limit", "5"]])
def test_restart_flags_without_an_engine_core_process_are_refused_not_ignored(tmp_path, flags):
    with pytest.raises(ConfigError, match="applies to --engine-process separate only"):
        serve_config(tmp_path, "--engine-process", "in-process", *flags)


def test_the_engine_core_process_is_the_default_so_the_restart_flags_need_no_other(tmp_path):
    config = serve_config(tmp_path, "--no-engine-restart", "--engine-restart-limit", "2")
    assert (config.engine_process, config.engine_restart, config.engine_restart_limit) == ("separate", False, 2)
    assert ServerConfig(data_dir=tmp_path, admin_token="x" * 16).engine_process == "separate"
    assert serve_config(tmp_path, "--engine-process", "in-process").engine_process == "in-process"


def test_a_limit_below_1_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(SystemExit):
        serve_config(tmp_path, "--engine-restart-limit", "0")
    with pytest.raises(ConfigError, match="--engine-restart-limit"):
        ServerConfig(data_dir=tmp_path, admin_token="x" * 16, engine_restart_limit=0)
