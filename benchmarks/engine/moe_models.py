"""Tiny random mixture-of-experts models (Mixtral, Qwen3-MoE) written by transformers, and PEFT adapters on
their attention and, by target_parameters, their fused experts (init_lora_weights=False): what the MoE
tests and benchmarks serve against transformers + peft."""
from __future__ import annotations

from pathlib import Path

import torch

from server.demo import make_tokenizer

VOCAB = 512
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2)
# name -> (transformers config class, model class, its config fields beyond TINY_SHAPE)
MOE_MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=48, num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(intermediate_size=128, moe_intermediate_size=48,
                                                                num_experts=4, head_dim=16, norm_topk_prob=True)),
}


def _decisive(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale projections and a router whose top-k are well apart, so greedy choices and routing are
    not decided by float noise (HF's std-0.02 init makes near-uniform logits)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 3 / p.shape[-1] ** 0.5)
            else:
                std = 2 / p.shape[-1] ** 0.5 if name == "lm_head.weight" else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def make_moe_model(out: Path, name: str, seed: int = 0, **shape) -> Path:
    """A random `name` (one of MOE_MODELS) written by transformers, with a tokenizer; `shape`: config fields
    over TINY_SHAPE and the model's own (hidden_size, num_local_experts, ...)."""
    import transformers

    config_cls, model_cls, extra = MOE_MODELS[name]
    make_tokenizer(out, VOCAB, model_max_length=1024)
    config = getattr(transformers, config_cls)(vocab_size=VOCAB, max_position_embeddings=1024,
                                               **(TINY_SHAPE | extra | shape))
    model = getattr(transformers, model_cls)(config)
    _decisive(model, seed)
    model.save_pretrained(out)
    return out


def make_moe_adapter(model_dir: Path, out: Path, r: int, lora_alpha: int, target_modules: list[str],
                     target_parameters: list[str], use_rslora: bool = False, use_dora: bool = False,
                     seed: int = 1, **patterns) -> Path:
    """B scaled so each delta is about half its base output: visible, not overwhelming."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, target_parameters=target_parameters,
                        use_rslora=use_rslora, use_dora=use_dora, init_lora_weights=False, lora_dropout=0.0,
                        **patterns)
    model = get_peft_model(base, config)
    scaling = lora_alpha / (r ** 0.5 if use_rslora else r)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / (r ** 0.5 * scaling))
    model.save_pretrained(out)
    return out
