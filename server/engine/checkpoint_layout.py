"""Which tensors a decoder layer's checkpoint holds, per architecture (Hugging Face names)."""
from __future__ import annotations

from adapters.format import FUSED_PROJECTION_ARCHS
from server.engine.config import ModelConfig
from server.engine.moe_weights import expert_keys


def layer_keys(cfg: ModelConfig, i: int, present=()) -> list[str]:
    """Every key layer i must have (biases are optional and not listed); present: the checkpoint's keys
    (an MoE checkpoint's experts come in one of two layouts, server.engine.moe_weights)."""
    p = f"model.layers.{i}."
    keys = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.o_proj.weight"]
    if cfg.is_sparse(i):
        keys += [p + f"self_attn.{n}_proj.weight" for n in "qkv"] + expert_keys(cfg, i, present)
    elif cfg.architecture in FUSED_PROJECTION_ARCHS:  # q/k/v and gate/up stored fused, in the engine's order
        keys += [p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
    else:
        keys += [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        keys += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    if cfg.qk_norm:
        keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if cfg.sandwich_norms:
        keys += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
    return keys
