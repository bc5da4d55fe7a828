"""Every dense architecture beyond the Llama family under --tensor-parallel-size (gloo): Qwen3's q/k
norms, Phi-3's fused qkv/gate_up, Gemma 2/3's sandwich norms, soft-caps, sliding windows and KV layer
groups. A mixed batch of base rows, LoRA and DoRA adapters at TP = 2 (both LoRA sharding modes) and
TP = 4 (a base whose kv heads divide by 4) generates TP = 1's greedy tokens and transformers + peft's
in float32, logprobs within 1e-4 of both."""
from __future__ import annotations

import pytest

from server.demo import make_adapter, make_base_model
from tests.engine_helpers import random_prompts
from tests.fixtures_architectures import ARCH_MODELS
from tests.server.engine.parallel.tp_serving import assert_tp_matches_peft, assert_tp_serves_as_tp1

KW = dict(device="cpu", dtype="float32", max_loras=3, max_lora_rank=16, kv_cache_blocks=128, max_model_len=256)
NAMES = ["r8_all", None, "r4_attn", "dora_r16", None, "r8_all"]
SEED = 7


# Gemma 2 is test_tp4_serves_gemma2's (its windows, soft-caps and KV groups at TP = 4); Gemma 3 has them at TP = 2.
@pytest.mark.parametrize("model, fully_sharded", [("qwen3", False), ("phi3", True), ("gemma3", True)])
def test_tp2_serves_every_dense_architecture(model, fully_sharded, arch_model, peft_oracle):
    model_dir, adapters = arch_model(model)
    llm, tokens, logprobs = assert_tp_serves_as_tp1(model_dir, adapters, KW, NAMES, SEED,
                                                    fully_sharded_loras=fully_sharded)
    assert llm.engine.runner.comm.calls["all_reduce"] > 0
    assert max(map(len, random_prompts(len(NAMES), (3, 30), 512, seed=SEED))) > 8  # past Gemma's window of 8
    assert_tp_matches_peft(model_dir, adapters, NAMES, SEED, tokens, logprobs, peft_oracle)


@pytest.fixture(scope="module")
def gemma2_kv4(tmp_path_factory):
    """Gemma 2 (windows, soft-caps, KV layer groups) with 4 kv heads: one a rank at TP = 4."""
    root = tmp_path_factory.mktemp("gemma2-kv4")
    arch, overrides, _ = ARCH_MODELS["gemma2"]
    model_dir = make_base_model(root / "base", arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                                intermediate_size=128, config_overrides=overrides)
    return model_dir, {"r8_all": make_adapter(model_dir, root / "r8_all", r=8, seed=61),
                       "r4_attn": make_adapter(model_dir, root / "r4_attn", r=4, lora_alpha=8, use_rslora=True,
                                               target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=62),
                       "dora_r16": make_adapter(model_dir, root / "dora_r16", r=16, lora_alpha=16, use_dora=True,
                                                seed=63)}


def test_tp4_serves_gemma2(gemma2_kv4, peft_oracle):
    model_dir, adapters = gemma2_kv4
    llm, tokens, logprobs = assert_tp_serves_as_tp1(model_dir, adapters, KW, NAMES, SEED, world_size=4)
    assert len(llm.engine.runner.workers) == 3
    assert llm.engine.model_config.kv_groups is not None  # a global and a windowed group, each sharded
    assert_tp_matches_peft(model_dir, adapters, NAMES, SEED, tokens, logprobs, peft_oracle)
