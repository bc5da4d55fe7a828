"""--data-parallel-size: refused in one line where it is not built (in-process, with tensor parallel,
fewer engine cores than cores asked for), accepted with several front ends (server.front_ends); the automatic CPU split gives every
engine core a core of its own on a small machine."""
from __future__ import annotations

import pytest

from server.config import ConfigError, ServerConfig
from server.cpu_placement import CpuPlacement, plan_placement
from tests.server.serve_config import serve_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("flags, refusal", [
    (["--engine-process", "in-process"], "--data-parallel-size 2 needs --engine-process separate"),
    (["--engine-process", "separate", "--tensor-parallel-size", "2"], "does not combine with --tensor-parallel-size 2"),
])
def test_refusals_are_one_line(tmp_path, flags, refusal):
    with pytest.raises(ConfigError, match=refusal) as raised:
        serve_config(tmp_path, "--data-parallel-size", "2", *flags)
    assert "\n" not in str(raised.value)


def test_routing_without_data_parallel_is_refused(tmp_path):
    """One engine core has nothing to route between: the flag would be accepted and ignored."""
    with pytest.raises(ConfigError, match="--data-parallel-routing applies with --data-parallel-size > 1 only"):
        serve_config(tmp_path, "--data-parallel-routing", "round-robin")
    assert serve_config(tmp_path).data_parallel_routing == "affinity"


@pytest.mark.parametrize("kw, refusal", [
    ({"cpu_placement": CpuPlacement(engine=(0,), api=(1,))}, "needs at least 2 engine cores"),
    ({"data_parallel_size": 0}, "--data-parallel-size must be >= 1"),
    ({"data_parallel_routing": "random"}, "--data-parallel-routing must be one of affinity, round-robin"),
])
def test_values_are_refused(tmp_path, kw, refusal):
    with pytest.raises(ConfigError, match=refusal):
        ServerConfig(data_dir=tmp_path, admin_token="x" * 16, engine_process="separate",
                     **{"data_parallel_size": 2, **kw})


def test_the_flags_reach_the_config(tmp_path):
    config = serve_config(tmp_path, "--engine-process", "separate", "--data-parallel-size", "2",
                     "--data-parallel-routing", "round-robin")
    assert (config.data_parallel_size, config.data_parallel_routing) == (2, "round-robin")
    both = serve_config(tmp_path, "--engine-process", "separate", "--data-parallel-size", "2",
                        "--api-server-count", "2")
    assert (both.data_parallel_size, both.api_server_count) == (2, 2)


def test_the_automatic_split_shares_the_cores_when_the_engine_needs_them_all():
    assert plan_placement(None, None, (0, 1), engine_groups=2) == CpuPlacement(engine=(0, 1), api=(0, 1))
    assert plan_placement(None, None, (0, 1)) == CpuPlacement(engine=(0,), api=(1,))
    assert plan_placement(None, None, tuple(range(8)), engine_groups=2) == CpuPlacement(engine=tuple(range(6)),
                                                                                        api=(6, 7))


def test_the_placement_line_names_the_engine_cores():
    line = CpuPlacement(engine=(0, 1), api=(0, 1)).line(separate=True, engines=2)
    assert line.startswith("cpu placement: 2 engine-core processes (a share each) on cores 0-1;")
