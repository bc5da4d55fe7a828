"""Context length and KV pool defaults: an unset --max-model-len fits the pool, an explicit one that
cannot fit is refused, and the choice is logged."""
from __future__ import annotations

import logging
from functools import partial

import pytest
import torch

from server.engine import LLM
from server.engine.config import ModelConfig
from server.engine.context_len import MIN_FULL_SEQUENCES, ContextLengthError, choose_max_model_len, model_limit
from server.engine.kv_cache import CPU_KV_MAX_BYTES, cpu_kv_budget_bytes, kv_bytes_per_block
from server.engine.sliding_window import sequence_blocks

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
    # The window is applied in attention, not as a cap on the context.
    assert model_limit(windowed, None) == 4096 and model_limit(windowed, 4096) == 4096
    assert windowed.layer_windows == (1024,) and windowed.kv_window == 1024


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


def test_a_window_in_every_layer_bounds_what_one_sequence_holds():
    """A model windowed in every layer holds its window and a step's chunk, whatever the length: a pool
    of 40 blocks of 16 serves 32768-token sequences of a 256-token window with 256-token steps."""
    held = partial(sequence_blocks, block_size=16, window=256, chunk=256)
    assert held(100) == 7 and held(32768) == 33
    assert choose_max_model_len(32768, 32768, num_blocks=40, block_size=16, held=held).max_model_len == 32768
    assert choose_max_model_len(None, 32768, num_blocks=132, block_size=16, held=held).max_model_len == 32768
    with pytest.raises(ContextLengthError, match="needs 33"):
        choose_max_model_len(32768, 32768, num_blocks=32, block_size=16, held=held)
    assert sequence_blocks(32768, 16, None, 256) == 2048


def test_qwen_windows_the_layers_its_layer_types_say():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "sliding_window": 64}
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"]}
    assert ModelConfig.from_dict(qwen).layer_windows is None  # use_sliding_window is false unless set
    on = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 2})
    assert on.layer_windows == (None, None, 64, 64) and on.kv_window is None
    typed = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 4})
    assert typed.kv_window == 64
    moe = ModelConfig.from_dict({**base, "architectures": ["Qwen3MoeForCausalLM"], "use_sliding_window": True,
                                 "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8})
    assert moe.layer_windows == (64,) * 4
    assert ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]}).layer_windows is None
    # Phi-3-mini-4k's 2047: transformers windows every layer with it.
    assert ModelConfig.from_dict({**base, "architectures": ["Phi3ForCausalLM"]}).kv_window == 64
    with pytest.raises(ValueError, match="sliding_window 0"):
        ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 0})
