"""What Gemma 2 and Gemma 3 (text) configs add to a decoder's: sandwich norms with `1 + w` gains,
GeGLU, scaled embeddings, soft-capped attention and logits, query_pre_attn_scalar, sliding-window
layers interleaved with global ones (each applied exactly in attention, never a cap on the context),
and Gemma 3's q/k norms and local rope base."""
from __future__ import annotations

from typing import Any

GEMMA_ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Before transformers wrote layer_types: every n-th layer global, the rest sliding.
_GLOBAL_EVERY = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class GemmaConfigError(ValueError):
    """A Gemma config asks for something loraplex does not reproduce exactly."""


def split_layer_ropes(rope: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global rope parameters, local ones or None): Gemma 3's rope_parameters hold one dict per layer type."""
    if "full_attention" not in rope:
        return rope, None
    return dict(rope["full_attention"]), dict(rope.get("sliding_attention") or {})


def gemma_fields(cfg: dict[str, Any], arch: str, local_rope: dict[str, Any] | None) -> dict[str, Any]:
    """ModelConfig's Gemma fields from a Gemma config.json (transformers 5 and 4.x spellings)."""
    if cfg.get("use_bidirectional_attention"):
        raise GemmaConfigError("use_bidirectional_attention (an embedding model's attention) is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise GemmaConfigError(f"hidden_activation {act!r} is not supported for {arch} (gelu_pytorch_tanh)")
    n = cfg["num_hidden_layers"]
    every = _GLOBAL_EVERY[arch] if arch == "Gemma2ForCausalLM" else cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    window = cfg.get("sliding_window")
    local_theta = None
    if arch == "Gemma3ForCausalLM":
        if local_rope and local_rope.get("rope_type", "default") != "default":
            raise GemmaConfigError(f"rope scaling {local_rope['rope_type']!r} on sliding layers is not supported")
        local_theta = float((local_rope or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    heads = cfg["num_attention_heads"]
    return dict(
        qk_norm=arch == "Gemma3ForCausalLM",
        norm_plus_one=True,
        sandwich_norms=True,
        hidden_act=act,
        scale_embeddings=True,
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or cfg["hidden_size"] // heads),
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        local_rope_theta=local_theta,
        sliding_window=None,  # applied per layer (layer_windows), not a cap on the context
    )
