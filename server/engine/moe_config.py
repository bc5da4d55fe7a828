"""Mixture-of-experts bases (Mixtral, Qwen3-MoE): their config.json fields, and what is refused.

Both route each token to its top-k experts by a softmax over the router's logits; Mixtral renormalises
the k weights always (a softmax over the top-k logits), Qwen3-MoE where `norm_topk_prob` says so.
Qwen3-MoE's dense layers (`mlp_only_layers`, and those `decoder_sparse_step` > 1 leaves between sparse
ones) hold a dense SwiGLU MLP of `intermediate_size`; shared experts (Qwen2-MoE's) are refused by name.
"""
from __future__ import annotations

from typing import Any

from adapters.expert_params import dense_layers

MOE_ARCHS = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


class MoeConfigError(ValueError):
    """An MoE config field set to something loraplex does not serve."""


def moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's MoE fields for `arch` (one of MOE_ARCHS)."""
    if arch == "MixtralForCausalLM":
        return {"num_experts": cfg.get("num_local_experts", 8),
                "num_experts_per_tok": cfg.get("num_experts_per_tok", 2),
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True}
    step = cfg.get("decoder_sparse_step", 1)
    if step is not None and (not isinstance(step, int) or step < 1):
        raise MoeConfigError(f"decoder_sparse_step {step!r} is not a positive int")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < cfg["num_hidden_layers"] for i in only):
        raise MoeConfigError(f"mlp_only_layers {only!r} is not a list of layer indices")
    if cfg.get("shared_expert_intermediate_size"):
        raise MoeConfigError("shared experts (shared_expert_intermediate_size) are not supported")
    # Hub configs say num_experts; transformers 5 writes num_local_experts (its attribute map's name).
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    return {"num_experts": experts, "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "dense_layers": dense_layers(cfg, cfg["num_hidden_layers"])}
