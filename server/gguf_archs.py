"""What llama.cpp's qwen3, phi3, gemma2 and gemma3 GGUF files hold beyond a llama's, mapped back to the
Hugging Face names and config fields (convert_hf_to_gguf's choices, undone): Qwen3's q/k norms; Phi-3's
fused attn_qkv and ffn_up (gate and up, in that order); Gemma's sandwich norms, stored as 1 + w, its
soft-caps and window, and what llama.cpp does not store but fixes by model: the local rope base
(10000), Gemma 3's one-global-in-six layers, and the attention scale (query_pre_attn_scalar: head_dim,
hidden / heads on the 27B models)."""
from __future__ import annotations

from typing import Any, Callable

# GGUF architecture -> (HF architecture, model_type)
EXTRA_ARCHS = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "phi3": ("Phi3ForCausalLM", "phi3"),
               "gemma2": ("Gemma2ForCausalLM", "gemma2"), "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
# Whose norm weights llama.cpp wrote as 1 + w (Gemma's gain): 1 is taken off again.
NORM_SHIFTED = ("gemma2", "gemma3")
_GEMMA_LAYER = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
LAYER_NAMES = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_LAYER,
    "gemma3": {**_GEMMA_LAYER, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
}
# The 27B Gemmas' layer counts: their attention scale is hidden / heads, not head_dim (llama.cpp's rule).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def arch_config(arch: str, key: Callable[..., Any], md: dict, base: dict, tensors: dict) -> dict:
    """config.json fields for `arch` beyond the llama ones in `base`; key(name, default) reads
    `{arch}.name` metadata (raising where it is missing and no default is given)."""
    if arch == "qwen3":
        return {"use_sliding_window": False}
    if arch == "phi3":
        if "rope_factors_long.weight" in tensors or md.get(f"{arch}.rope.scaling.type", "none") != "none":
            raise ValueError("Phi-3's longrope scaling is not supported")
        rotary = key("rope.dimension_count", base["head_dim"])
        return {"sliding_window": md.get(f"{arch}.attention.sliding_window"),
                "partial_rotary_factor": rotary / base["head_dim"]}
    layers = base["num_hidden_layers"]
    scalar = (base["hidden_size"] // base["num_attention_heads"] if layers == _GEMMA_27B_LAYERS[arch]
              else base["head_dim"])
    every = 2 if arch == "gemma2" else key("attention.sliding_window_pattern", 6)
    out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
           "sliding_window": key("attention.sliding_window"),
           "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)],
           "attn_logit_softcapping": md.get(f"{arch}.attn_logit_softcapping"),
           "final_logit_softcapping": md.get(f"{arch}.final_logit_softcapping"),
           "tie_word_embeddings": "output.weight" not in tensors}
    if arch == "gemma3":
        full = {"rope_type": "default", "rope_theta": base["rope_theta"]}
        if md.get(f"{arch}.rope.scaling.type", "none") == "linear":
            full |= {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        out["rope_parameters"] = {"full_attention": full,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return out
