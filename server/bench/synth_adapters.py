"""Random PEFT LoRA adapters for sweeps, written straight from config.json shapes.

Hundreds of adapters (or any for an 8B-shaped model) are too slow to make
through peft's get_peft_model; the files written here are ordinary PEFT
directories (adapter_config.json + adapter_model.safetensors) that peft and
loraplex both load. Cached by model shape, rank and index; deterministic.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """module -> (in_features, out_features) for a Llama-family config.json."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    q, kv = heads * head_dim, (cfg.get("num_key_value_heads") or heads) * head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _module(name: str) -> str:
    return f"self_attn.{name}" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else f"mlp.{name}"


def write_adapter(model_dir: Path, out_dir: Path, *, r: int, seed: int, dtype: torch.dtype = torch.float32,
                  target_modules: tuple[str, ...] = SEVEN) -> Path:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = projection_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name in target_modules:
            fan_in, fan_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.{_module(name)}"
            # A keeps A x at the input's scale; B makes the delta a modest fraction of the output.
            tensors[f"{key}.lora_A.weight"] = (torch.randn(r, fan_in, generator=gen) / math.sqrt(fan_in)).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, r, generator=gen) * 0.2 / r).to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
              "target_modules": list(target_modules), "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "rank_pattern": {},
              "alpha_pattern": {}, "inference_mode": True, "init_lora_weights": True,
              "base_model_name_or_path": str(Path(model_dir).resolve())}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def model_key(model_dir: Path) -> str:
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:12]


def ensure_adapters(model_dir: Path, cache_root: Path, indices: list[int], *, r: int,
                    dtype: torch.dtype = torch.float32) -> dict[int, Path]:
    """index -> adapter dir under cache_root/<model key>/r<r>-<dtype>/<index>, made once."""
    root = Path(cache_root) / model_key(model_dir) / f"r{r}-{str(dtype).removeprefix('torch.')}"
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for i in indices:
        dest = root / f"{i:04d}"
        if not (dest / "adapter_config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{i:04d}.", dir=root))
            try:
                write_adapter(model_dir, tmp, r=r, seed=10_000 + i, dtype=dtype)
                os.chmod(tmp, 0o755)
                if dest.exists():
                    shutil.rmtree(dest)  # a leftover without its config: an interrupted build
                os.replace(tmp, dest)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp)
        out[i] = dest
    return out
