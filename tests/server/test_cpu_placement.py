"""--engine-cpus / --api-cpus as server.cpu_placement plans them: the automatic split, each flag
alone, both, and the lists it refuses in one line (a serve with them exits 2 with that line)."""
from __future__ import annotations

import pytest

from server.cli import build_parser
from server.config import ConfigError, ServerConfig
from server.cpu_list import CpuListError, format_cpu_list, parse_cpu_list
from server.cpu_placement import CpuPlacement, CpuPlacementError, plan_placement

pytestmark = pytest.mark.unit


def test_core_lists_read_and_write_as_proc_does():
    assert parse_cpu_list("0") == (0,)
    assert parse_cpu_list("1-3") == (1, 2, 3)
    assert parse_cpu_list("3,0-1, 1") == (0, 1, 3)
    assert format_cpu_list((0, 1, 3, 5, 6, 7)) == "0-1,3,5-7"
    for bad in ("", "a", "3-1", "-1", "1-", "0,,1"):
        with pytest.raises(CpuListError):
            parse_cpu_list(bad)


def test_the_automatic_split():
    assert plan_placement(None, None, (0,)) is None  # one core: nothing pinned
    assert plan_placement(None, None, (0, 1)) == CpuPlacement(engine=(0,), api=(1,))
    assert plan_placement(None, None, tuple(range(8))) == CpuPlacement(engine=(0, 1, 2, 3, 4, 5), api=(6, 7))
    assert plan_placement(None, None, (2, 5, 9)) == CpuPlacement(engine=(2, 5), api=(9,))
    # In-process (one interpreter: HTTP and the step loop share a GIL) only the flags pin.
    assert plan_placement(None, None, (0, 1), automatic=False) is None
    assert plan_placement("0", None, (0, 1), automatic=False) == CpuPlacement(engine=(0,), api=(1,))


def test_one_flag_leaves_the_rest_to_the_other_side():
    assert plan_placement("1", None, (0, 1, 2, 3)) == CpuPlacement(engine=(1,), api=(0, 2, 3))
    assert plan_placement(None, "0", (0, 1, 2, 3)) == CpuPlacement(engine=(1, 2, 3), api=(0,))
    assert plan_placement("0-1", "3", (0, 1, 2, 3)) == CpuPlacement(engine=(0, 1), api=(3,))


@pytest.mark.parametrize("engine, api, words", [
    ("0-1", "1-2", "overlap on core(s) 1"),
    ("0", "0", "overlap on core(s) 0"),
    ("0-3", None, "leaves no core for the other side"),
    ("7", None, "core(s) 7 are not among the cores this process may use (0-3)"),
    (None, "2-9", "--api-cpus 2-9: core(s) 4-9"),
    ("x", None, "--engine-cpus: 'x' is not a core list"),
])
def test_refused_lists_are_one_line_naming_the_flag(engine, api, words):
    with pytest.raises(CpuPlacementError) as e:
        plan_placement(engine, api, (0, 1, 2, 3))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_config_refuses_them_as_a_config_error(tmp_path):
    args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), "--engine-cpus", "0", "--api-cpus", "0"])
    with pytest.raises(ConfigError, match="overlap on core"):
        ServerConfig.from_args(args, env={})


def test_a_config_built_in_code_pins_nothing(tmp_path):
    assert ServerConfig(data_dir=tmp_path, admin_token="lpadm-" + "x" * 20).cpu_placement is None


def test_the_start_up_lines():
    from server.cpu_placement import unpinned_line

    assert unpinned_line((0,)) == "cpu placement: one core (0), nothing pinned"
    assert unpinned_line((0, 1)).startswith("cpu placement: cores 0-1, nothing pinned")
    placement = CpuPlacement(engine=(0, 1, 2), api=(3,))
    assert placement.line(separate=True).startswith("cpu placement: engine-core process on cores 0-2; ")
    assert placement.line(separate=False) == ("cpu placement: server process (HTTP and the engine's step loop, one "
                                              "interpreter) on cores 0-2; grammar compiles, adapter loaders and "
                                              "Redis on cores 3")
