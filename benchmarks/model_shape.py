"""`--model-shape smol135`: a realistic small model for the CPU bench, with random weights.

SmolLM-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536, vocabulary
49152, tied embeddings: 163M parameters) is big enough that matmuls, not Python, dominate a CPU
step, which the 4-layer demo model cannot show. No hub: the tokenizer is the demo byte-level BPE
(512 ids) with synthetic tokens appended up to the full vocabulary, because a BPE trained on the
shipped corpus stops far short of 49152 merges and the lm_head's width is what costs. Every id
decodes (the synthetic ones to `<x12345>`), so both servers can detokenize whatever they sample.
Weights use the demo's decisive scales, so greedy argmax has clear winners.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors.torch import save_file

SMOL135 = MappingProxyType({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": True,
    "attention_bias": False, "mlp_bias": False,
})
MODEL_SHAPES = MappingProxyType({"smol135": SMOL135})


class ModelShapeError(ValueError):
    """An unknown shape name or a layer count that cannot be built."""


def extend_vocab(tokenizer_json: Path, vocab_size: int) -> None:
    """Append `<xNNNNN>` tokens to a byte-level BPE's vocabulary until it has vocab_size ids.

    They sit in the BPE vocabulary without merges: encoding never produces them, but decoding
    maps each to its printable ASCII text (byte-level maps printable ASCII to itself).
    """
    doc = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = doc["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in doc.get("added_tokens", [])}
    used_ids = set(vocab.values()) | {t["id"] for t in doc.get("added_tokens", [])}
    next_id = max(used_ids) + 1
    if next_id > vocab_size:
        raise ModelShapeError(f"the tokenizer already has {next_id} ids, more than {vocab_size}")
    for i in range(next_id, vocab_size):
        token = f"<x{i:05d}>"
        assert token not in taken, token
        vocab[token] = i
    tokenizer_json.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")


def _weights(cfg: dict, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Llama parameters under Hugging Face names, at the demo's decisive scales (server.demo)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def proj(out_features: int, in_features: int) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)).to(dtype)

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=dtype)

    tied = cfg["tie_word_embeddings"]
    # Tied, the embedding is also the head: kept small so the input token's own logit does not win
    # every argmax, and the final norm's gain of 4 restores the logit scale (as server.demo does).
    embed = torch.randn(vocab, h, generator=gen) * (0.5 / math.sqrt(h) if tied else 1.0)  # [V, h]
    out = {"model.embed_tokens.weight": embed.to(dtype), "model.norm.weight": ones() * (4.0 if tied else 1.0)}
    if not tied:
        out["lm_head.weight"] = (torch.randn(vocab, h, generator=gen) * 2.0 / math.sqrt(h)).to(dtype)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
            p + "self_attn.q_proj.weight": proj(q, h), p + "self_attn.k_proj.weight": proj(kv, h),
            p + "self_attn.v_proj.weight": proj(kv, h), p + "self_attn.o_proj.weight": proj(h, q),
            p + "mlp.gate_proj.weight": proj(inter, h), p + "mlp.up_proj.weight": proj(inter, h),
            p + "mlp.down_proj.weight": proj(h, inter)})
    return out


def build_model_shape(name: str, out_dir: str | Path, *, num_layers: int | None = None, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> Path:
    """Write a Hugging Face model directory of the named shape; reused when already complete.

    num_layers: fewer layers of the same widths (tests). config.json is written last, so its
    presence with the same content marks a complete directory.
    """
    from server.demo import DEMO_VOCAB, make_tokenizer

    if name not in MODEL_SHAPES:
        raise ModelShapeError(f"unknown model shape {name!r} (known: {', '.join(MODEL_SHAPES)})")
    if num_layers is not None and num_layers < 1:
        raise ModelShapeError(f"num_layers must be >= 1, got {num_layers}")
    cfg = dict(MODEL_SHAPES[name], dtype=str(dtype).removeprefix("torch."))
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
    out = Path(out_dir)
    done = out / "config.json"
    if done.is_file() and json.loads(done.read_text()) == {**cfg, **_special_ids(out)}:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)
    make_tokenizer(out, DEMO_VOCAB, model_max_length=cfg["max_position_embeddings"])
    extend_vocab(out / "tokenizer.json", cfg["vocab_size"])
    cfg.update(_special_ids(out))
    save_file(_weights(cfg, seed, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def _special_ids(model_dir: Path) -> dict[str, int]:
    """bos/eos/pad ids as the tokenizer written in model_dir assigns them."""
    from server.demo import BOS, EOS, PAD

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return {}
    added = {t["content"]: t["id"] for t in json.loads(path.read_text(encoding="utf-8"))["added_tokens"]}
    return {"bos_token_id": added[BOS], "eos_token_id": added[EOS], "pad_token_id": added[PAD]}
