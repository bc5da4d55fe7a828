"""Pre-quantized checkpoints: GPTQ 4-bit in the Hugging Face layout, dequantized to the model dtype at load.

Most adapters in the wild were trained (QLoRA) on a 4-bit base, and GPTQ's layout is the one
transformers/optimum, AutoGPTQ and GPTQModel write (`quantization_config.quant_method: gptq`,
`checkpoint_format: gptq`). Per quantized linear layer `L`, with G groups of input channels:

    L.qweight [in / 8, out] int32   eight 4-bit q[i, o], input channel 8r + j at bits 4j of row r
    L.qzeros  [G, out / 8]  int32   eight 4-bit stored zeros z[g, o], output 8c + j at bits 4j of column c
    L.scales  [G, out]      float16
    L.g_idx   [in]          int32   the group of each input channel (act-order permutes them); optional

and w[o, i] = scales[g[i], o] * (q[i, o] - (z[g[i], o] + 1)): the "gptq" format stores each zero less
one (its v2 format does not, and is refused here rather than read off by one).

Served two ways. With --quantization int4 the 4-bit values stay 4-bit (int4_from_gptq: transposed and
repacked into kernels.int4_weights' layout, the same numbers), and the matmuls dequantize them per tile;
act-order checkpoints (g_idx not i // group_size) are refused there, since their groups are not runs of
input channels. Otherwise the weights become float at load (dequantize_checkpoint; then --quantization
int8 or fp8 may requantize them). Either way the PEFT oracle is transformers + peft on the dequantized
weights. Every other quantized format is refused with what is supported.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.int4_weights import GROUP_MULTIPLE, Int4Weight, pack_nibbles
from server.engine.config import ModelConfigError

SUPPORTED = ("GPTQ 4-bit in the Hugging Face layout (quant_method gptq, bits 4, checkpoint_format gptq), "
             "or an unquantized checkpoint")
PARTS = ("qweight", "qzeros", "scales", "g_idx")
PACK = 8  # 4-bit values per int32
_FLOAT_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj\.weight")


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


def refuse_float_projections(keys, spec: GptqSpec | None, where: str) -> None:
    """ModelConfigError when config.json says GPTQ but a layer projection is a float `.weight`: the
    config would be silently wrong about what is served (the float weights would serve as they are)."""
    if spec is None:
        return
    floats = sorted(k for k in keys if _FLOAT_PROJECTION.fullmatch(k))
    if floats:
        raise ModelConfigError(f"{where}: config.json's quantization_config says GPTQ 4-bit, but {len(floats)} "
                               f"projections are float tensors, not GPTQ (qweight, qzeros, scales), e.g. "
                               f"{floats[0]}; drop quantization_config to serve it as a float checkpoint")


def check_checkpoint(model_dir: str | Path, require_gptq: bool = False) -> GptqSpec | None:
    """The checkpoint's GPTQ spec (None: float), from config.json and the safetensors headers only (no
    tensor is read, so the CLI runs it before the server starts and a mistake is one line):
    ModelConfigError for an unsupported quantization_config, a GPTQ config over float projections, or
    a float checkpoint where `require_gptq` (--quantization gptq)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelConfigError(f"{config_path} not found: --model must be a Hugging Face model directory")
    spec = checkpoint_quantization(json.loads(config_path.read_text()))
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            refuse_float_projections(f.keys(), spec, str(model_dir))
    if spec is None and require_gptq:
        raise ModelConfigError(f"--quantization gptq serves a GPTQ checkpoint's own 4-bit weights, and {model_dir} is "
                               f"not one (no quantization_config): use --quantization int4 to quantize it at load")
    return spec


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


def _layers(parts: dict[str, torch.Tensor]):
    """(layer, (qweight, qzeros, scales, g_idx or None)) per quantized layer, in key order."""
    for layer in sorted({key.rsplit(".", 1)[0] for key in parts}):
        missing = [p for p in PARTS[:3] if f"{layer}.{p}" not in parts]
        if missing:
            raise ModelConfigError(f"GPTQ layer {layer} lacks {', '.join(missing)}")
        yield layer, (parts[f"{layer}.qweight"], parts[f"{layer}.qzeros"], parts[f"{layer}.scales"],
                      parts.get(f"{layer}.g_idx"))


def dequantize_checkpoint(parts: dict[str, torch.Tensor], spec: GptqSpec) -> dict[str, torch.Tensor]:
    """Every quantized layer's `.weight` [out, in] float32 from its GPTQ tensors (parts: checkpoint key ->
    tensor, the PARTS only)."""
    return {f"{layer}.weight": dequantize_gptq(*tensors, spec.group_size) for layer, tensors in _layers(parts)}

def int4_from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                   group_size: int) -> Int4Weight:
    """The same weight as dequantize_gptq's, bit for bit, kept in 4 bits: q repacked per output row,
    scales widened to float32 and offsets m = -scale * (z + 1), both exact (kernels.int4_weights). Raises ModelConfigError for what kernels.int4_weights cannot
    hold: act-order groups, a group size that is not a multiple of 32, widths not multiples of 16.
    Shape: as dequantize_gptq's arguments; returns an Int4Weight of [out, in]."""
    q = _unpack(qweight, 0)  # [in, out]
    n_in, n_out = q.shape
    group_size = n_in if group_size == -1 else group_size
    groups = -(-n_in // group_size)
    if n_in % 16 or group_size % GROUP_MULTIPLE:
        raise ModelConfigError(f"--quantization int4 serves GPTQ groups of a multiple of {GROUP_MULTIPLE} input "
                               f"channels over widths that are multiples of 16, not groups of {group_size} over "
                               f"{n_in}: serve this checkpoint without --quantization (dequantized at load)")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(n_in) // group_size):
        raise ModelConfigError("--quantization int4 cannot serve an act-order (desc_act) GPTQ checkpoint: its groups "
                               "are not runs of input channels; serve it without --quantization (dequantized at "
                               "load) or with --quantization int8")
    z = _unpack(qzeros, 1) + 1  # [G, out], 1..16
    if z.shape != (groups, n_out) or scales.shape != (groups, n_out):
        raise ModelConfigError(f"GPTQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                               f"scales {tuple(scales.shape)}")
    scale = scales.float().t().contiguous()  # [out, G]
    return Int4Weight(pack_nibbles(q.t()), scale, (-scale * z.t().float()).contiguous(), group_size)


def int4_checkpoint(parts: dict[str, torch.Tensor], spec: GptqSpec) -> dict[str, Int4Weight]:
    """dequantize_checkpoint's keys, each layer's weight kept in 4 bits (int4_from_gptq)."""
    return {f"{layer}.weight": int4_from_gptq(*tensors, spec.group_size) for layer, tensors in _layers(parts)}
