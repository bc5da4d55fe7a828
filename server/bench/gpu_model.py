"""The GPU mode's model: Llama-3-8B-shaped, random weights, no download.

Weights are drawn on the accelerator, written as per-layer safetensors shards to
a tmpfs directory (/dev/shm by default, so "on disk" is RAM) and read from
there by both loraplex and the transformers baseline. The tokenizer is the demo
BPE (512 ids); prompts use ids below 512, the model's full 128256-entry vocab
and lm_head are kept so the compute is 8B's. Outputs are meaningless; speed is
what is measured.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}


def make_llama3_8b_shaped(out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                          num_layers: int | None = None, seed: int = 0) -> Path:
    """num_layers: fewer layers for a quick smoke test of the same widths."""
    from server.demo import make_tokenizer

    out = Path(out_dir)
    cfg = dict(LLAMA3_8B, dtype=str(dtype).removeprefix("torch."))
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == cfg:
        return out  # made earlier in this tmpfs
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)  # ids 0, 1, 2 are BOS, EOS, PAD, as in cfg
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
                / shape[-1] ** 0.5).to(dtype).cpu()

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    shard("model-embed.safetensors", {"model.embed_tokens.weight": rand(vocab, h),
                                      "model.norm.weight": torch.ones(h, dtype=dtype), "lm_head.weight": rand(vocab, h)})
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shard(f"model-layer{i:03d}.safetensors", {p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
                   p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                   p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                   p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                   p + "mlp.down_proj.weight": rand(h, inter)})
    # transformers finds shards through the index; loraplex globs *.safetensors.
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # Written last: its presence marks a complete directory.
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out
