"""MoE bases (Mixtral, Qwen3-MoE) under --tensor-parallel-size 2 (server.engine.parallel.tp_moe): every expert's intermediate columns split, the router replicated,
expert LoRA (PEFT's target_parameters) sharded as the dense layers' default. A mixed batch of base rows,
attention and expert LoRA and an attention DoRA adapter generates TP = 1's greedy tokens and
transformers + peft's in float32, logprobs within 1e-4 of both."""
from __future__ import annotations

import pytest

from tests.server.engine.parallel.tp_serving import assert_tp_matches_peft, assert_tp_serves_as_tp1

KW = dict(device="cpu", dtype="float32", max_loras=4, max_lora_rank=16, kv_cache_blocks=128, max_model_len=256)
NAMES = ["r8_all", None, "r4_qv", "r2_experts", "r8_all", "dora_r16", None, "r2_experts"]
SEED = 9


# One base: TpMoeBlock cuts Mixtral's and Qwen3-MoE's experts alike (both at TP = 1: test_engine_moe);
# Qwen3-MoE's q/k norms and renormalised top-k add to what Mixtral would show.
@pytest.mark.parametrize("model", ["qwen3_moe"])
def test_tp2_serves_moe_as_tp1_and_peft(model, moe_model, peft_oracle):
    model_dir, adapters = moe_model(model)
    llm, tokens, logprobs = assert_tp_serves_as_tp1(model_dir, adapters, KW, NAMES, SEED)
    assert type(llm.engine.runner.model.layers[0].moe).__name__ == "TpMoeBlock"
    assert_tp_matches_peft(model_dir, adapters, NAMES, SEED, tokens, logprobs, peft_oracle)
