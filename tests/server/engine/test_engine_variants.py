"""Llama-family variants: Qwen2 biases, Mistral, tied embeddings, llama3 rope scaling, dtypes."""
from __future__ import annotations

import json

import pytest
import torch

from server.demo import make_adapter
from server.engine import LLM, ModelConfig
from tests.engine_helpers import assert_matches_peft, greedy, random_prompts
from tests.fixtures_models import LLAMA3_ROPE

pytestmark = pytest.mark.unit

VARIANTS = {
    "qwen2": dict(arch="qwen2"),
    "mistral": dict(arch="mistral"),
    "tied": dict(arch="llama", tie=True),
    "llama3-rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_peft(variant, model_variant_dir, tmp_path, peft_oracle):
    model_dir = model_variant_dir(**VARIANTS[variant])
    adapters = {"lora": make_adapter(model_dir, tmp_path / "lora", r=8, seed=31)}
    llm = LLM(model_dir, device="cpu", dtype="float32", kv_cache_blocks=64, max_model_len=512)
    llm.add_adapter("lora", adapters["lora"])
    # Prompts past the llama3 variant's original 256-token context exercise the scaled frequencies.
    prompts = random_prompts(4, (20, 300), 512, seed=32)
    names = ["lora", None, "lora", None]
    outs = llm.generate(prompts, greedy(6), adapters=names)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 6, peft_oracle)


def test_config_reads_both_spellings():
    base = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
    }
    old = ModelConfig.from_dict({**base, "torch_dtype": "bfloat16", "rope_theta": 500000.0,
                                 "rope_scaling": dict(LLAMA3_ROPE)})
    new = ModelConfig.from_dict({**base, "dtype": "bfloat16",
                                 "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE}})
    for cfg in (old, new):
        assert cfg.checkpoint_dtype == "bfloat16"
        assert cfg.rope_theta == 500000.0
        assert cfg.rope_scaling["rope_type"] == "llama3"
        assert cfg.num_kv_heads == 2 and cfg.head_dim == 4


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(dtype, tiny_model_dir, tiny_adapters):
    # Exactness is a float32 promise; in half precision the first greedy tokens should still agree.
    prompts = random_prompts(4, (8, 16), 512, seed=33)
    ref = LLM(tiny_model_dir, device="cpu", dtype="float32", kv_cache_blocks=64, max_model_len=256)
    half = LLM(tiny_model_dir, device="cpu", dtype=dtype, kv_cache_blocks=64, max_model_len=256)
    for llm in (ref, half):
        llm.add_adapter("a", tiny_adapters["r8_all"])
    names = ["a", None, "a", None]
    first_ref = [o.token_ids[0] for o in ref.generate(prompts, greedy(3), adapters=names)]
    outs = half.generate(prompts, greedy(3), adapters=names)
    assert half.engine.model.embed.dtype == getattr(torch, dtype)
    assert sum(o.token_ids[0] == r for o, r in zip(outs, first_ref)) >= 3
