"""Pre-quantized checkpoints: GPTQ 4-bit in the Hugging Face layout, dequantized to the model dtype at load.

Most adapters in the wild were trained (QLoRA) on a 4-bit base, and GPTQ's layout is the one
transformers/optimum, AutoGPTQ and GPTQModel write (`quantization_config.quant_method: gptq`,
`checkpoint_format: gptq`). Per quantized linear layer `L`, with G groups of input channels:

    L.qweight [in / 8, out] int32   eight 4-bit q[i, o], input channel 8r + j at bits 4j of row r
    L.qzeros  [G, out / 8]  int32   eight 4-bit stored zeros z[g, o], output 8c + j at bits 4j of column c
    L.scales  [G, out]      float16
    L.g_idx   [in]          int32   the group of each input channel (act-order permutes them); optional

and w[o, i] = scales[g[i], o] * (q[i, o] - (z[g[i], o] + 1)): the "gptq" format stores each zero less
one (its v2 format does not, and is refused here rather than read off by one). The weights become
float at load, so every kernel, adapter and the PEFT oracle (transformers + peft on those dequantized
weights) work unchanged; what is saved is download size, not serving memory: for that, add
--quantization int8 (CPU) on top. Every other quantized format is refused with what is supported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.config import ModelConfigError

SUPPORTED = ("GPTQ 4-bit in the Hugging Face layout (quant_method gptq, bits 4, checkpoint_format gptq), "
             "or an unquantized checkpoint")
PARTS = ("qweight", "qzeros", "scales", "g_idx")
PACK = 8  # 4-bit values per int32


@dataclass(frozen=True)
class GptqSpec:
    group_size: int  # input channels per group; -1: one group for the whole row


def checkpoint_quantization(config: dict) -> GptqSpec | None:
    """The checkpoint's quantization from its config.json, None for a float checkpoint;
    ModelConfigError, naming what is supported, for any other format."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelConfigError(f"quantization_config must be an object; supported: {SUPPORTED}")
    method, bits = qc.get("quant_method"), qc.get("bits")
    fmt = qc.get("checkpoint_format") or "gptq"
    if method != "gptq" or bits != 4 or fmt != "gptq":
        raise ModelConfigError(f"checkpoint quantization {method!r} (bits {bits}, format {fmt!r}) is not supported; "
                               f"supported: {SUPPORTED}")
    group_size = qc.get("group_size", 128)
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ModelConfigError(f"GPTQ group_size must be a positive integer or -1, got {group_size!r}")
    return GptqSpec(group_size)


def is_gptq_part(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in PARTS


def _unpack(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32 along `dim`, value j at bits 4j. Shape: dim grows 8x; int32 out."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]
    if dim == 0:
        return ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).flatten(0, 1)  # [rows * 8, cols]
    return ((packed[:, :, None] >> shifts[None, None, :]) & 0xF).flatten(1, 2)  # [rows, cols * 8]


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """Semantics: w[o, i] = scales[g[i], o] * (q[i, o] - (z[g[i], o] + 1)) in float32, g = g_idx or
    i // group_size. Shape: qweight [in/8, out], qzeros [G, out/8], scales [G, out], g_idx [in];
    returns [out, in] float32, contiguous."""
    q = _unpack(qweight, 0)  # [in, out]
    z = _unpack(qzeros, 1) + 1  # [G, out]
    n_in, n_out = q.shape
    groups = scales.shape[0]
    if g_idx is None:
        g_idx = torch.arange(n_in) // (n_in if group_size == -1 else group_size)
    g_idx = g_idx.long()
    if z.shape != (groups, n_out) or g_idx.shape != (n_in,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ModelConfigError(f"GPTQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                               f"scales {tuple(scales.shape)}, g_idx {tuple(g_idx.shape)}")
    w = scales.float()[g_idx] * (q - z[g_idx]).float()  # [in, out]
    return w.t().contiguous()


def dequantize_checkpoint(parts: dict[str, torch.Tensor], spec: GptqSpec) -> dict[str, torch.Tensor]:
    """Every quantized layer's `.weight` [out, in] float32 from its GPTQ tensors (parts: checkpoint key ->
    tensor, the PARTS only)."""
    layers = {key.rsplit(".", 1)[0] for key in parts}
    out = {}
    for layer in sorted(layers):
        missing = [p for p in PARTS[:3] if f"{layer}.{p}" not in parts]
        if missing:
            raise ModelConfigError(f"GPTQ layer {layer} lacks {', '.join(missing)}")
        out[f"{layer}.weight"] = dequantize_gptq(parts[f"{layer}.qweight"], parts[f"{layer}.qzeros"],
                                                 parts[f"{layer}.scales"], parts.get(f"{layer}.g_idx"),
                                                 spec.group_size)
    return out
