"""A quantized copy of a float Llama checkpoint in a layout vLLM's CPU backend reads (`--peer-quantization`).

So that both servers of `python -m benchmarks.serving.bench --peer vllm` serve the same quantized weights, the decoder's
seven projections are quantized with loraplex's own int8 quantizer (kernels.int8_weights.quantize_int8:
per-output-channel symmetric, s[o] = max|w[o, :]| / 127, q = round(w / s) in [-127, 127]) and written
in compressed-tensors' layouts; loraplex serves the float checkpoint with `--quantization int8`, which
computes the very same q and s at load. Embeddings, norms and the (tied) lm_head stay float, as both
servers leave them by default. The formats (`quantization_config.quant_method: compressed-tensors`):

    w8a8-int8   format int-quantized: L.weight [out, in] int8, L.weight_scale [out, 1] float32; vLLM also
                quantizes activations to int8 per token at run time (dynamic), loraplex does not.
    w8a16-int8  format pack-quantized (weight-only, what loraplex computes): L.weight_packed [out, in / 4]
                int32, four q + 128 per word, value j at bits 8j; L.weight_scale [out, 1] float32;
                L.weight_shape [2] int64.
    gptq-4bit   Hugging Face GPTQ (quant_method gptq, bits 4, sym, one group per GROUP input channels,
                no act-order; server.engine.gptq_checkpoint documents the layout), symmetric round to
                nearest: not loraplex's int8 scales, a 4-bit model both servers load (loraplex dequantizes it).

read_dequantized() reads any of them back as float32 `.weight` tensors (the writer's round-trip test);
write_int8_reference() writes the float checkpoint the transformers + peft oracle of an int8 side runs:
every projection replaced by dequantize(quantize_int8(w)).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from kernels.int8_weights import Int8Weight, dequantize_int8, quantize_int8

PEER_QUANTIZATIONS = ("none", "w8a8-int8", "w8a16-int8", "gptq-4bit")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPTQ_GROUP = 64  # divides smol135's 576 and 1536 (128 does not divide 576)
WEIGHTS_FILE = "model.safetensors"


class QuantizedCheckpointError(ValueError):
    """A format this writer does not know, or a checkpoint it cannot quantize."""


def is_projection(key: str) -> bool:
    """A decoder projection's weight (`model.layers.N.self_attn.q_proj.weight`, ...)."""
    layer, _, leaf = key.rpartition(".")
    return leaf == "weight" and ".layers." in key and layer.rsplit(".", 1)[-1] in PROJECTIONS


def _int8_args(strategy: str) -> dict:
    return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": strategy == "token",
            "group_size": None, "block_structure": None, "actorder": None, "observer": None}


def quantization_config(kind: str) -> dict:
    """config.json's quantization_config for `kind` (one of PEER_QUANTIZATIONS but none)."""
    if kind == "gptq-4bit":
        return {"quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq"}
    if kind not in ("w8a8-int8", "w8a16-int8"):
        raise QuantizedCheckpointError(f"unknown peer quantization {kind!r} (known: {', '.join(PEER_QUANTIZATIONS)})")
    group = {"targets": ["Linear"], "weights": _int8_args("channel"),
             "input_activations": _int8_args("token") if kind == "w8a8-int8" else None, "output_activations": None}
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed",
            "format": "int-quantized" if kind == "w8a8-int8" else "pack-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None}


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 for 8 bits along the input dim, bit for bit.
    Semantics: word[o, c] = sum_j (q[o, 4c + j] + 128) << 8j, as a two's-complement int32.
    Shape: q [out, in] int8, in % 4 == 0; returns [out, in / 4] int32."""
    assert q.dtype == torch.int8 and q.dim() == 2 and q.shape[1] % 4 == 0
    u = (q.long() + 128).view(q.shape[0], -1, 4)  # [out, in/4, 4] in 0..255
    word = (u << (torch.arange(4) * 8)).sum(dim=2)  # [out, in/4] < 2^32
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """pack_int8's inverse. Shape: packed [out, in / 4] int32; returns [out, in] int8."""
    u = (packed.long()[:, :, None] >> (torch.arange(4) * 8)) & 0xFF  # [out, in/4, 4]
    return (u - 128).flatten(1).to(torch.int8)


def _pack4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32 along dim, value j at bits 4j (AutoGPTQ's pack).
    Shape: values [rows, cols] in 0..15; dim 0: [rows / 8, cols], dim 1: [rows, cols / 8] int32."""
    v = values.long()
    v = v.view(-1, 8, v.shape[1]) if dim == 0 else v.view(v.shape[0], -1, 8)
    shifts = (torch.arange(8) * 4).view((1, 8, 1) if dim == 0 else (1, 1, 8))
    word = (v << shifts).sum(dim=1 if dim == 0 else 2)  # < 2^32
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def gptq4_tensors(w: torch.Tensor, group: int = GPTQ_GROUP) -> dict[str, torch.Tensor]:
    """Symmetric 4-bit GPTQ tensors of w by round to nearest: per group g of `group` input channels and
    output o, s = max|w| / 7 (float16), q = clamp(round(w / s), -8, 7) + 8, stored zero 8 - 1.
    Shape: w [out, in], in % group == 0 and out % 8 == 0; qweight [in/8, out], qzeros [G, out/8], scales [G, out]."""
    n_out, n_in = w.shape
    if n_in % group or n_out % 8:
        raise QuantizedCheckpointError(f"a [{n_out}, {n_in}] weight does not split into {group}-channel groups "
                                       "and 8-output words")
    wt = w.t().float().reshape(n_in // group, group, n_out)  # [G, group, out]
    amax = wt.abs().amax(dim=1)  # [G, out]
    scales = torch.where(amax > 0, amax / 7, torch.ones_like(amax)).half()  # [G, out]
    q = (torch.round(wt / scales.float()[:, None, :]).clamp(-8, 7) + 8).reshape(n_in, n_out)  # [in, out]
    zeros = torch.full((n_in // group, n_out), 7)  # the format stores zero - 1
    return {"qweight": _pack4(q, 0), "qzeros": _pack4(zeros, 1), "scales": scales}


def _quantize(kind: str, key: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    layer = key.removesuffix(".weight")
    if kind == "gptq-4bit":
        return {f"{layer}.{p}": t for p, t in gptq4_tensors(w).items()}
    iw = quantize_int8(w, scale_dtype=torch.float32)
    scale = iw.scale[:, None].contiguous()  # [out, 1]
    if kind == "w8a8-int8":
        return {key: iw.qweight, f"{layer}.weight_scale": scale}
    return {f"{layer}.weight_packed": pack_int8(iw.qweight), f"{layer}.weight_scale": scale,
            f"{layer}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}


def write_quantized_checkpoint(src_dir: str | Path, out_dir: str | Path, kind: str) -> Path:
    """out_dir: src_dir's model with its decoder projections quantized as `kind`, every other tensor and
    file copied; reused when its config.json already says the same. config.json is written last."""
    config = _float_config(Path(src_dir))
    config["quantization_config"] = quantization_config(kind)
    config["torch_dtype"] = config.get("dtype", "float32")
    return _write(Path(src_dir), Path(out_dir), config, lambda key, w: _quantize(kind, key, w))


def write_int8_reference(src_dir: str | Path, out_dir: str | Path) -> Path:
    """out_dir: src_dir's float model with each decoder projection w replaced by dequantize(quantize_int8(w)),
    in w's dtype: the weights `--quantization int8` serves, for the transformers + peft oracle."""
    config = _float_config(Path(src_dir))
    config["int8_reference_of"] = str(Path(src_dir).resolve())  # marks the copy, so it is reused only as itself
    return _write(Path(src_dir), Path(out_dir), config,
                  lambda key, w: {key: dequantize_int8(quantize_int8(w), w.dtype).contiguous()})


def _float_config(src: Path) -> dict:
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise QuantizedCheckpointError(f"{src} is already quantized: give a float checkpoint")
    return config


def _write(src: Path, out: Path, config: dict, convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
           ) -> Path:
    done = out / "config.json"
    if done.is_file() and json.loads(done.read_text()) == config:
        return out
    out.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    tensors: dict[str, torch.Tensor] = {}
    converted = 0
    for f in sorted(src.glob("*.safetensors")):
        for key, w in load_file(f).items():
            converted += is_projection(key)
            tensors |= convert(key, w) if is_projection(key) else {key: w}
    if not converted:
        raise QuantizedCheckpointError(f"{src} has no decoder projections to quantize")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    done.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def read_dequantized(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint this module wrote, quantized projections as float32 `.weight` [out, in]."""
    from server.engine.gptq_checkpoint import GptqSpec, dequantize_checkpoint, is_gptq_part

    d = Path(model_dir)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    tensors = load_file(d / WEIGHTS_FILE)
    if qc["quant_method"] == "gptq":
        parts = {k: t for k, t in tensors.items() if is_gptq_part(k)}
        rest = {k: t for k, t in tensors.items() if k not in parts}
        return rest | dequantize_checkpoint(parts, GptqSpec(qc["group_size"]))
    out = {}
    for key, t in tensors.items():
        layer, _, leaf = key.rpartition(".")
        if leaf in ("weight_scale", "weight_shape"):
            continue
        if leaf == "weight_packed":
            q = unpack_int8(t)[:, : int(tensors[f"{layer}.weight_shape"][1])]
        elif leaf == "weight" and t.dtype == torch.int8:
            q = t
        else:
            out[key] = t
            continue
        iw = Int8Weight(q.contiguous(), tensors[f"{layer}.weight_scale"].flatten())
        out[f"{layer}.weight"] = dequantize_int8(iw)
    return out
