"""Tiny random models of every architecture beyond the Llama family, each with random PEFT adapters on
every module PEFT can target in it (one of them DoRA), built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from server.demo import PHI3_MODULES, SEVEN, make_adapter, make_base_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# name -> (make_base_model's arch, its config_overrides, rope_scaling)
ARCH_MODELS = {
    "qwen3": ("qwen3", {}, None),
    "qwen3-yarn": ("qwen3", {}, YARN),
    "phi3": ("phi3", {}, None),
    # Windows of 8 under prompts of up to 90 tokens, caps that bend unit-scale scores and logits, a
    # query_pre_attn_scalar apart from head_dim 16; Gemma 3's local and global rope bases as it defaults.
    "gemma2": ("gemma2", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                              attn_logit_softcapping=2.0, final_logit_softcapping=5.0, query_pre_attn_scalar=24), None),
    "gemma3": ("gemma3", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                              final_logit_softcapping=5.0, query_pre_attn_scalar=24), None),
    # Gemma 3 4B and up: linear scaling on the global layers only.
    "gemma3-linear": ("gemma3", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                      "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                         "rope_theta": 1000000.0}}), None),
}


def targets(arch: str) -> tuple[str, ...]:
    """Every Linear module of a layer as PEFT names it."""
    return PHI3_MODULES if arch == "phi3" else SEVEN


@pytest.fixture(scope="session")
def arch_model(tmp_path_factory):
    """arch_model(name in ARCH_MODELS) -> (model_dir, {adapter name: dir}): "r8_all" (every module),
    "r4_attn" (the attention ones, rsLoRA) and "dora_r16" (every module, DoRA)."""
    cache: dict[str, tuple[Path, dict[str, Path]]] = {}

    def get(name: str) -> tuple[Path, dict[str, Path]]:
        if name not in cache:
            arch, overrides, rope = ARCH_MODELS[name]
            root = tmp_path_factory.mktemp(name)
            model_dir = make_base_model(root / "base", arch, hidden_size=64, num_layers=2, num_heads=4,
                                        num_kv_heads=2, intermediate_size=128, rope_scaling=rope,
                                        config_overrides=overrides)
            every = targets(arch)
            cache[name] = model_dir, {
                "r8_all": make_adapter(model_dir, root / "r8_all", r=8, target_modules=every, seed=41),
                "r4_attn": make_adapter(model_dir, root / "r4_attn", r=4, lora_alpha=8, use_rslora=True,
                                        target_modules=every[: len(every) // 2], seed=42),
                "dora_r16": make_adapter(model_dir, root / "dora_r16", r=16, lora_alpha=16, target_modules=every,
                                         seed=43, use_dora=True),
            }
        return cache[name]

    return get
