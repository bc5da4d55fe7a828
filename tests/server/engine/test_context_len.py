"""Context length and KV pool defaults: an unset --max-model-len fits the pool, an explicit one that
cannot fit is refused, and the choice is logged."""
from __future__ import annotations

import logging

import pytest
import torch

from server.engine import LLM
from server.engine.config import ModelConfig
from server.engine.context_len import MIN_FULL_SEQUENCES, ContextLengthError, choose_max_model_len, model_limit
from server.engine.kv_cache import CPU_KV_MAX_BYTES, cpu_kv_budget_bytes, kv_bytes_per_block

pytestmark = pytest.mark.unit

GIB = 1 << 30
# SmolLM2-135M's shape: 30 layers of 3 KV heads of 64, 8192 positions (the failing default).
SMOL = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                              "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                              "num_key_value_heads": 3, "max_position_embeddings": 8192})


def _smol_context(total_memory: int) -> int:
    per_block = kv_bytes_per_block(SMOL, 16, torch.float32)
    blocks = cpu_kv_budget_bytes(total_memory, per_block, max_num_seqs=256, blocks_per_seq=8192 // 16) // per_block
    return choose_max_model_len(None, model_limit(SMOL, None), blocks, 16).max_model_len


def test_a_real_checkpoint_gets_its_full_context_on_this_machine_size_and_less_on_a_small_one():
    assert kv_bytes_per_block(SMOL, 16, torch.float32) == 737280  # 364 blocks in the old fixed 256 MiB
    assert _smol_context(24 * GIB) == 8192  # 2.4 GiB: 3495 blocks, 6 sequences of 8192
    small = _smol_context(4 * GIB)  # 0.4 GiB: 582 blocks, so 145 blocks each for 4 sequences
    assert small == (582 // MIN_FULL_SEQUENCES) * 16 == 2320


def test_cpu_budget_is_a_share_of_memory_capped_and_never_more_than_usable():
    per_block = 1 << 20
    assert cpu_kv_budget_bytes(16 * GIB, per_block, 256, 512) == int(1.6 * GIB)
    assert cpu_kv_budget_bytes(512 * GIB, per_block, 256, 512) == CPU_KV_MAX_BYTES
    # 2 sequences of 8 blocks cannot use more than 16 blocks, whatever the machine has
    assert cpu_kv_budget_bytes(512 * GIB, per_block, 2, 8) == 16 * per_block


def test_choice_rules_and_their_reasons():
    full = choose_max_model_len(None, 1024, num_blocks=256, block_size=16)  # 4096 tokens = 4 x 1024
    assert full.max_model_len == 1024 and "the model's limit" in full.reason
    fitted = choose_max_model_len(None, 1024, num_blocks=100, block_size=16)
    assert fitted.max_model_len == 25 * 16 and "the model allows 1024" in fitted.reason
    assert choose_max_model_len(None, 1024, num_blocks=2, block_size=16).max_model_len == 16
    given = choose_max_model_len(1000, 1024, num_blocks=63, block_size=16)  # 63 x 16 = 1008 >= 1000
    assert given.max_model_len == 1000 and "as given" in given.reason
    with pytest.raises(ContextLengthError, match=r"needs 63.*--kv-cache-blocks"):
        choose_max_model_len(1000, 1024, num_blocks=62, block_size=16)


def test_model_limits_refuse_explicit_lengths_past_them():
    assert model_limit(SMOL, None) == 8192
    with pytest.raises(ContextLengthError, match="max_position_embeddings 8192"):
        model_limit(SMOL, 8193)
    windowed = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                                      "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "max_position_embeddings": 4096, "sliding_window": 1024})
    assert model_limit(windowed, None) == 1024
    with pytest.raises(ContextLengthError, match="sliding window 1024"):
        model_limit(windowed, 2048)


def test_engine_fits_an_unset_length_to_the_pool_and_logs_it(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="server.engine.engine_startup"):
        llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=16, max_num_seqs=4)
    assert llm.engine.max_model_len == 64  # 16 blocks of 16 tokens hold 4 sequences of 64, of the model's 1024
    assert any("max_model_len 64 (the model allows 1024)" in r.getMessage() for r in caplog.records)


def test_engine_uses_the_models_length_when_the_memory_share_holds_it(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="server.engine.engine_startup"):
        llm = LLM(tiny_model_dir, device="cpu", max_num_seqs=4)
    assert llm.engine.max_model_len == 1024
    # max_num_seqs sequences of the full length is all the pool is given
    assert llm.engine.blocks.num_blocks == 4 * 1024 // 16
    assert any("max_model_len 1024: the model's limit" in r.getMessage() for r in caplog.records)


def test_engine_refuses_an_explicit_length_the_pool_cannot_hold(tiny_model_dir):
    with pytest.raises(ContextLengthError, match=r"has 16 blocks of 16 tokens .* needs 64"):
        LLM(tiny_model_dir, device="cpu", kv_cache_blocks=16, max_model_len=1024)
    with pytest.raises(ContextLengthError, match="exceeds the model's max_position_embeddings"):
        LLM(tiny_model_dir, device="cpu", max_model_len=4096)
