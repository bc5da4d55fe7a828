"""Writing GPTQ 4-bit checkpoints in the Hugging Face layout from a float one, for the tests: asymmetric,
groups of `group` input channels, act-order g_idx optionally, packed bit for bit as AutoGPTQ does."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gptq_config(group: int, act_order: bool) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": False,
            "checkpoint_format": "gptq"}


def pack_words(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32 along dim, value j at bits 4j (AutoGPTQ's pack), bit for bit."""
    v = values.long()
    v = v.view(-1, 8, v.shape[1]) if dim == 0 else v.view(v.shape[0], -1, 8)
    shifts = (torch.arange(8) * 4).view((1, 8, 1) if dim == 0 else (1, 1, 8))
    word = (v << shifts).sum(dim=1 if dim == 0 else 2)  # < 2^32
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def gptq_quantize(w: torch.Tensor, gen: torch.Generator, group: int,
                  act_order: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(GPTQ tensors of w [out, in], and the float32 weight they stand for, [out, in]). act_order: each
    group's channels scattered by a random g_idx; else channel i is in group i // group."""
    n_out, n_in = w.shape
    g_idx = (torch.randperm(n_in, generator=gen) if act_order else torch.arange(n_in)) // group
    wt = w.t().float()  # [in, out]
    groups = n_in // group
    lo = torch.stack([wt[g_idx == g].amin(dim=0) for g in range(groups)]).clamp(max=0)  # [G, out]
    hi = torch.stack([wt[g_idx == g].amax(dim=0) for g in range(groups)]).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half()  # [G, out], stored float16
    # Zeros 1..16: the format stores zero - 1 in 4 bits, so a zero of 0 cannot be written (GPTQ's own limit).
    zeros = torch.round(-lo / scales.float()).clamp(1, 16)  # [G, out]
    q = (torch.round(wt / scales.float()[g_idx]) + zeros[g_idx]).clamp(0, 15)  # [in, out]
    tensors = {"qweight": pack_words(q, 0), "qzeros": pack_words(zeros - 1, 1), "scales": scales, "g_idx": g_idx.int()}
    return tensors, (scales.float()[g_idx] * (q - zeros[g_idx])).t().contiguous()


def write_gptq_checkpoint(model_dir: Path, gptq: Path, ref: Path, group: int, act_order: bool, seed: int = 0) -> None:
    """`model_dir`'s projections GPTQ-quantized into `gptq`, and `ref`: the float checkpoint of the
    weights they stand for (the transformers + peft oracle's)."""
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, gptq / f.name)
            shutil.copy(f, ref / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    (gptq / "config.json").write_text(json.dumps({**config, "quantization_config": gptq_config(group, act_order)}))
    gen = torch.Generator().manual_seed(seed)
    for f in model_dir.glob("*.safetensors"):
        tensors = load_file(f)
        packed, floats = {}, {}
        for key, w in tensors.items():
            layer, _, leaf = key.rpartition(".")
            if leaf == "weight" and layer.split(".")[-1] in PROJECTIONS:
                parts, floats[key] = gptq_quantize(w, gen, group, act_order)
                packed |= {f"{layer}.{p}": t for p, t in parts.items()}
            else:
                packed[key] = floats[key] = w
        save_file(packed, gptq / f.name, metadata={"format": "pt"})
        save_file(floats, ref / f.name, metadata={"format": "pt"})
