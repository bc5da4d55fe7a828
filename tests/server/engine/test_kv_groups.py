"""KV layer groups (server.engine.kv_groups): interleaved windowed and global layers split into groups of
equal size, global first; one kind of layer alone is no grouping; what a sequence holds over its groups."""
from __future__ import annotations

import json

import pytest

from server.engine.config import ModelConfig, ModelConfigError
from server.engine.kv_groups import KvGroups

pytestmark = pytest.mark.unit


def test_gemma2_alternating_layers_make_two_groups_of_half():
    groups = KvGroups.of((8, None, 8, None))
    assert groups.windows == (None, 8)
    assert groups.layer_group == (1, 0, 1, 0) and groups.layer_slot == (0, 0, 1, 1)
    assert groups.layers_per_group == 2


def test_gemma3_five_to_one_makes_a_global_group_and_five_windowed():
    groups = KvGroups.of((20,) * 5 + (None,) + (20,) * 5 + (None,))
    assert groups.windows == (None, 20, 20, 20, 20, 20) and groups.layers_per_group == 2
    assert groups.layer_group[5] == groups.layer_group[11] == 0
    # Each pool tensor (a place in a group) serves one layer of every group.
    for slot in (0, 1):
        assert sorted(g for g, s in zip(groups.layer_group, groups.layer_slot) if s == slot) == list(range(6))


@pytest.mark.parametrize("windows", [None, (None, None), (8, 8), (8, 12)])
def test_one_kind_of_layer_is_no_grouping(windows):
    assert KvGroups.of(windows) is None


def test_held_blocks_count_the_global_groups_whole_and_the_windowed_ones_windowed():
    groups = KvGroups.of((20, None))
    # 4096 tokens in blocks of 16: 256 in the global group; in the other, the 19 positions behind a
    # 32-token chunk and the chunk (51: 4 blocks) and a partial block at the far end.
    assert groups.held_blocks(4096, 16, 32) == 256 + 5


def test_a_draft_model_is_refused_for_an_interleaved_target(tiny_model_dir):
    from server.engine.draft_model_loader import read_draft_config

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    target = ModelConfig.from_dict({**cfg, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                    "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1})
    with pytest.raises(ModelConfigError, match="interleaved with global ones"):
        read_draft_config(str(tiny_model_dir), target)


def test_the_pool_has_the_bytes_kv_cache_blocks_asks_for_in_group_blocks(tiny_model_dir):
    """kv_cache_blocks counts blocks of every layer: Gemma 2's four layers in two groups of two get twice
    the blocks, of half the bytes, and a layer of each group shares each pool tensor."""
    import torch

    from server.engine.config import EngineConfig
    from server.engine.kv_cache import allocate_kv_cache, kv_bytes_per_block

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    mcfg = ModelConfig.from_dict({**cfg, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                                  "num_hidden_layers": 4, "sliding_window": 20, "head_dim": 16,
                                  "hidden_activation": "gelu_pytorch_tanh",
                                  "layer_types": ["sliding_attention", "full_attention"] * 2})
    config = EngineConfig.of(model=str(tiny_model_dir), kv_cache_blocks=10, device="cpu")
    caches, info = allocate_kv_cache(mcfg, config, 256, torch.float32, torch.device("cpu"))
    assert info.blocks == 20 and info.bytes == 10 * kv_bytes_per_block(mcfg, config.cache.block_size, torch.float32)
    assert info.tokens == 10 * config.cache.block_size
    assert len(caches) == 4 and caches[0] is caches[1] and caches[2] is caches[3] and caches[0] is not caches[2]
    assert caches[0][0].shape[0] == 20
