"""--cpu-threads: resolution of `auto` from the affinity mask, explicit counts, and the plumbing
from the CLI and the Python API down to torch's thread pool."""
from __future__ import annotations

import pytest
import torch

from server.cli import build_parser
from server.config import ConfigError, ServerConfig
from server.engine import EngineConfig, LLMEngine
from server.engine.cpu_threads import CpuThreadsError, auto_threads, parse_cpu_threads, resolve_cpu_threads


def _mask(n: int):
    return lambda: set(range(n))


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 1), (16, 15), (64, 63)])
def test_auto_uses_the_affinity_mask_less_a_core_for_the_http_side(cores, expected):
    assert resolve_cpu_threads("auto", affinity=_mask(cores)) == expected


def test_auto_counts_the_mask_not_the_machine():
    # Pinned to cores 40..47 of a larger machine: 8 allowed cores, whatever the core ids.
    assert resolve_cpu_threads("auto", affinity=lambda: {40, 41, 42, 43, 44, 45, 46, 47}) == 7


def test_auto_reads_the_real_affinity_by_default():
    import os

    cores = len(os.sched_getaffinity(0))
    assert resolve_cpu_threads("auto") == auto_threads(cores)


@pytest.mark.parametrize("value, expected", [(1, 1), (3, 3), ("4", 4), (" 2 ", 2), (128, 128)])
def test_explicit_counts_are_honoured_whatever_the_mask(value, expected):
    assert resolve_cpu_threads(value, affinity=_mask(2)) == expected


def test_none_leaves_torch_alone():
    assert resolve_cpu_threads(None, affinity=_mask(16)) is None


@pytest.mark.parametrize("bad", [0, -1, "0", "many", "", "2.5", 2.0, True])
def test_bad_values_are_refused(bad):
    with pytest.raises(CpuThreadsError):
        parse_cpu_threads(bad)


def test_an_empty_mask_is_an_error():
    with pytest.raises(CpuThreadsError):
        resolve_cpu_threads("auto", affinity=lambda: set())


def test_engine_config_defaults_to_auto_and_normalises_text(tiny_model_dir):
    assert EngineConfig.of(model=str(tiny_model_dir)).device.cpu_threads == "auto"
    assert EngineConfig.of(model=str(tiny_model_dir), cpu_threads="3").device.cpu_threads == 3
    assert EngineConfig.of(model=str(tiny_model_dir), cpu_threads=None).device.resolve_cpu_threads() is None
    with pytest.raises(ValueError):
        EngineConfig.of(model=str(tiny_model_dir), cpu_threads=0)


def test_cli_flag_reaches_the_server_config(tmp_path):
    parser = build_parser()
    assert parser.parse_args(["serve"]).cpu_threads == "auto"
    args = parser.parse_args(["serve", "--data-dir", str(tmp_path), "--admin-token", "x" * 16,
                              "--cpu-threads", "3"])
    assert ServerConfig.from_args(args, env={}).engine.device.cpu_threads == 3
    args = parser.parse_args(["serve", "--data-dir", str(tmp_path), "--admin-token", "x" * 16,
                              "--cpu-threads", "lots"])
    with pytest.raises(ConfigError, match="--cpu-threads"):
        ServerConfig.from_args(args, env={})


def test_the_engine_sets_torch_threads(tiny_model_dir):
    def engine(threads):
        return LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64, max_model_len=256,
                                         cpu_threads=threads))

    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            engine(n)
            assert torch.get_num_threads() == n
        torch.set_num_threads(3)
        engine(None)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
