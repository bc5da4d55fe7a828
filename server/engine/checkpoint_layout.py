"""Which tensors a decoder layer's checkpoint holds, per architecture (Hugging Face names)."""
from __future__ import annotations

from adapters.format import FUSED_PROJECTION_ARCHS
from server.engine.config import ModelConfig


def layer_keys(cfg: ModelConfig, i: int) -> list[str]:
    """Every key layer i must have (biases are optional and not listed)."""
    p = f"model.layers.{i}."
    keys = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.o_proj.weight",
            p + "mlp.down_proj.weight"]
    if cfg.architecture in FUSED_PROJECTION_ARCHS:  # q/k/v and gate/up stored fused, in the engine's order
        keys += [p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight"]
    else:
        keys += [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        keys += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")]
    if cfg.qk_norm:
        keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if cfg.sandwich_norms:
        keys += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
    return keys
