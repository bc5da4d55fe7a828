"""PEFT adapters with parts of embed_tokens and lm_head (LoRA on them, modules_to_save), written by peft for
the tests of adapters.vocab_format and server.engine.lora.vocab_parts."""
from __future__ import annotations

import math
from pathlib import Path

import torch


def make_vocab_adapter(model_dir: Path, out: Path, *, target_modules: list[str],
                       modules_to_save: list[str] | None = None, r: int = 4, lora_alpha: int = 8, seed: int = 0,
                       resize_vocab: int | None = None) -> Path:
    """A PEFT directory (init_lora_weights=False) whose every LoRA delta and saved copy visibly differs
    from the base: LoRA B drawn so each delta is about half its module's output, and each saved module's
    copy moved off the base's by noise of the weights' own scale. resize_vocab: resize_token_embeddings first."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if resize_vocab is not None:
        base.resize_token_embeddings(resize_vocab, mean_resizing=False)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, modules_to_save=modules_to_save,
                        init_lora_weights=False, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=gen) * p.std())
            elif "lora_A" in name or "lora_embedding_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / (math.sqrt(r) * lora_alpha / r)))
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)
    return out
