"""Adapters as PEFT wrote them for an MoE model on transformers 4 (per-expert Linear modules, adapters.expert_linears),
and the oracle for them on transformers 5: the base with each Linear LoRA merged by hand."""
from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

from adapters.expert_linears import EXPERT_LINEARS
from adapters.expert_params import dense_layers

MLP = ("gate_proj", "up_proj", "down_proj")


def _matches(name: str, key: str) -> bool:
    """PEFT's match of a plain target or pattern key: the name, or a dotted suffix of it."""
    return name == key or name.endswith("." + key)


def linear_modules(model_dir: Path, arch: str, target_modules: list[str]) -> list[tuple[int, int, str, str]]:
    """(layer, expert or -1, module name, its kind: the Linear's name, dense_* for a dense MLP's) of every
    module target_modules names."""
    cfg = json.loads((model_dir / "config.json").read_text())
    block, names = EXPERT_LINEARS[arch]
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    dense = dense_layers(cfg, cfg["num_hidden_layers"]) if arch == "Qwen3MoeForCausalLM" else ()
    out = []
    for layer in range(cfg["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((layer, -1, f"model.layers.{layer}.self_attn.{proj}", proj))
        if layer in dense:  # a dense MLP's Linears, of intermediate_size
            out += [(layer, -1, f"model.layers.{layer}.mlp.{proj}", f"dense_{proj}") for proj in MLP]
            continue
        for e in range(experts):
            out += [(layer, e, f"model.layers.{layer}.{block}.experts.{e}.{n}", n) for n in names]
    return [m for m in out if any(_matches(m[2], t) for t in target_modules)]


def make_linear_adapter(model_dir: Path, like: Path, out: Path, arch: str, r: int, alpha: int, targets: list[str],
                        rank_pattern: dict, alpha_pattern: dict, seed: int) -> Path:
    """What PEFT saved for these targets on transformers 4: per-module lora_A [r, in] / lora_B [out, r], its
    config `like`'s (a peft-written adapter of this model) with these fields."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    inter, dense = cfg.get("moe_intermediate_size") or cfg["intermediate_size"], cfg["intermediate_size"]
    gate, up, down = EXPERT_LINEARS[arch][1]
    in_out = {"q_proj": (h, heads * head_dim), "k_proj": (h, kv * head_dim), "v_proj": (h, kv * head_dim),
              "o_proj": (heads * head_dim, h), gate: (h, inter), up: (h, inter), down: (inter, h),
              "dense_gate_proj": (h, dense), "dense_up_proj": (h, dense), "dense_down_proj": (dense, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for _, _, name, proj in linear_modules(model_dir, arch, targets):
        rank = next((v for k, v in rank_pattern.items() if _matches(name, k)), r)
        scaling = next((v for k, v in alpha_pattern.items() if _matches(name, k)), alpha) / rank
        n_in, n_out = in_out[proj]
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * n_in ** -0.5
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.5 / (
            rank ** 0.5 * scaling)
    out.mkdir(parents=True)
    config = json.loads((like / "adapter_config.json").read_text())
    config |= {"r": r, "lora_alpha": alpha, "target_modules": targets, "target_parameters": None,
               "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "use_rslora": False, "use_dora": False}
    (out / "adapter_config.json").write_text(json.dumps(config))
    safetensors.torch.save_file(tensors, out / "adapter_model.safetensors")
    return out


def merged_model(model_dir: Path, adapter: Path, arch: str, out: Path) -> Path:
    """The base with each Linear LoRA merged as PEFT's Linear LoRA computes it (transformers 5's fused
    experts: gate rows then up rows of gate_up_proj[e], down_proj[e])."""
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter / "adapter_config.json").read_text())
    saved = safetensors.torch.load_file(adapter / "adapter_model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    gate, up, _ = EXPERT_LINEARS[arch][1]
    with torch.no_grad():
        for layer, e, name, proj in linear_modules(model_dir, arch, config["target_modules"]):
            a, b = saved[f"base_model.model.{name}.lora_A.weight"], saved[f"base_model.model.{name}.lora_B.weight"]
            alpha = next((v for k, v in config["alpha_pattern"].items() if _matches(name, k)), config["lora_alpha"])
            delta = alpha / a.shape[0] * (b @ a)
            if e < 0:
                params[f"{name}.weight"] += delta
                continue
            experts = f"model.layers.{layer}.mlp.experts."
            if proj in (gate, up):
                inter = delta.shape[0]
                lo = 0 if proj == gate else inter
                params[experts + "gate_up_proj"][e, lo: lo + inter] += delta
            else:
                params[experts + "down_proj"][e] += delta
    model.save_pretrained(out)
    return out
