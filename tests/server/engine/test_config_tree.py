"""EngineConfig as a tree of sections: flat names routed to the section declaring each, unknown ones
refused naming them, each section validating its own fields, and the tree crossing msgpack intact (the
engine-core process and its data-parallel siblings get it that way)."""
from __future__ import annotations

import dataclasses

import msgspec
import pytest

from server.engine.config import SECTIONS, EngineConfig, LoraConfig, SchedulerConfig, setting_names

pytestmark = pytest.mark.unit


def test_flat_names_land_in_their_sections():
    config = EngineConfig.of("m", max_loras=3, block_size=32, device="cpu", max_num_seqs=7, quantization="int8",
                             tensor_parallel_size=2,
                             speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert (config.lora.max_loras, config.cache.block_size, config.device.device) == (3, 32, "cpu")
    assert (config.scheduler.max_num_seqs, config.quantization.quantization) == (7, "int8")
    assert config.parallel.tensor_parallel_size == 2 and config.speculative_config.num_speculative_tokens == 2
    assert config.with_settings(max_loras=5).lora == dataclasses.replace(config.lora, max_loras=5)


def test_every_setting_is_declared_once():
    declared = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(declared) == len(set(declared))
    assert set(setting_names()) == set(declared) | {"model", "speculative_config"}


def test_an_unknown_name_is_refused_naming_it():
    with pytest.raises(TypeError, match="max_lorras"):
        EngineConfig.of("m", max_lorras=8)


@pytest.mark.parametrize("flat, words", [
    ({"max_loras": 0}, "max_loras must be >= 1"),
    ({"lora_page_rows": 3}, "lora_page_rows must be a power of two"),
    ({"unified_memory": True}, "unified_memory needs lora_page_rows"),
    ({"quantize_lm_head": True}, "quantize_lm_head needs quantization 'int8'"),
    ({"max_cpu_loras": 2, "max_cpu_lora_bytes": 10}, "give one"),
    ({"async_scheduling": True, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "does not combine with async_scheduling"),
    ({"max_prefill_tokens_while_decoding": "auto", "max_prefill_step_ratio": 1.5}, "auto sets its own"),
])
def test_each_rule_refuses_once(flat, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig.of("m", **flat)


def test_the_prefill_cap_auto_resolves_by_device_type():
    config = EngineConfig.of("m", max_prefill_tokens_while_decoding="auto")
    assert config.resolved_for("cpu").scheduler.max_prefill_tokens_while_decoding == 256
    assert config.resolved_for("cuda").scheduler.max_prefill_tokens_while_decoding is None
    assert EngineConfig.of("m").resolved_for("cpu").scheduler == SchedulerConfig()  # the Python API's: off


def test_max_cpu_loras_counts_adapters_of_the_loaded_model():
    assert LoraConfig(max_cpu_loras=3).host_budget_bytes(1000) == 3000
    assert LoraConfig(max_cpu_lora_bytes=5).host_budget_bytes(1000) == 5
    assert LoraConfig().host_budget_bytes(1000) is None


def test_the_tree_crosses_msgpack():
    config = EngineConfig.of("m", max_loras=2, lora_page_rows=16, unified_memory=True, cpu_affinity=(3, 1),
                             quantization="gptq", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig) == config
