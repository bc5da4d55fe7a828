"""DoRA's per-output scale g = m / ||W + scaling * B @ A||, computed against the served base weights.

PEFT (0.21, tuners/lora/dora.py, in eval mode) adds to a DoRA module's base output
    (g - 1) * (x W^T) + g * scaling * B(A(x)),   g = m / ||W + scaling * B @ A|| per output row,
the norm taken over each row of the [out, in] weight (fan_in_fan_out is False for nn.Linear),
detached. So the module computes
    g * (x W^T + scaling * x A^T B^T) + bias:
the plain LoRA output, bias aside, scaled per output column by g, which depends on the adapter and the
base weights only. It is computed once, when the adapter enters a device slot (server.engine.lora.slots),
and the forward applies it as one gathered multiply (kernels.dora_scale).

PEFT materialises W + scaling * B @ A ([out, in]) and takes its row norms: four passes over a
weight-sized temporary, which made a rank-16 DoRA load of the smol135 shape 40x a LoRA load on a CPU.
Here each row's squared norm is expanded instead,
    ||W_j||^2 + 2 scaling (W A^T)_j . B_j + scaling^2 B_j (A A^T) B_j^T,
which reads W once (a [out, r] product) and keeps ||W_j||^2 per base projection after the first DoRA
load. The expansion loses precision where the adapter nearly cancels a row (the sum far below
||W_j||^2): rows below CANCELLATION of it are recomputed as PEFT does, materialised, so the result stays
within float32 rounding of PEFT's whatever the adapter. Work on W goes a bounded block of rows at a
time, so no weight-sized temporary of a large projection is ever allocated.

A row whose W + scaling * B @ A is all zeros gives PEFT m / 0 (inf, or NaN); its output x (W + sBA)^T is
exactly 0 whatever g, so g is 0 there: the row serves 0 where PEFT would serve NaN.
"""
from __future__ import annotations

import torch

from kernels.fp8_weights import Fp8Weight
from kernels.int4_weights import Int4Weight, rows_int4
from kernels.int8_weights import Int8Weight

# Rows of W (as float32) taken at a time: 4 Mi float32 (16 MiB) whatever the projection.
BLOCK_ELEMENTS = 4 << 20
# A row whose expanded squared norm is below this fraction of ||W_j||^2 is recomputed exactly: there the
# expansion's float32 rounding (~1e-7 of ||W_j||^2) would be above ~1e-5 of the result.
CANCELLATION = 1e-2
# The model's attribute for each slot group (server.engine.lora.slots.PROJECTION_SLICES).
_GROUP_ATTRS = {"qkv": "qkv", "o": "o", "gate_up": "gate_up", "down": "down"}


class DoraScales:
    """Per layer, the fused base weight of each slot group, to compute DoRA scales against."""

    def __init__(self, weights: list[dict[str, torch.Tensor | Int8Weight]]) -> None:
        self.weights = weights  # per layer: group -> [sum n_i, in] fused weight (float, or int8 with row scales)
        self._row_norms_sq: dict[tuple[int, str], torch.Tensor] = {}  # (layer, group) -> [sum n_i] float32

    @classmethod
    def of_model(cls, model) -> "DoraScales":
        """From a server.engine.model.CausalLM: the weights its LoraLinear layers serve."""
        return cls([{g: getattr(layer, attr).weight for g, attr in _GROUP_ATTRS.items()
                     if getattr(layer, attr) is not None}  # an MoE layer's experts: no DoRA there
                    for layer in model.layers])

    @torch.inference_mode()
    def compute(self, layer: int, group: str, row: int, a: torch.Tensor, b: torch.Tensor, scaling: float,
                magnitude: torch.Tensor, out: torch.Tensor) -> None:
        """Write g = m / ||W + scaling * B @ A|| (0 where the norm is 0) for one projection into `out`.

        Shape: a [r, in] and b [n, r] (the slot's, serving dtype); magnitude [n] float32; out [n] float32;
        the projection is rows row .. row + n of the layer's fused `group` weight [sum n_i, in].
        """
        weight = self.weights[layer][group]
        n = b.shape[0]
        a32, b32 = a.float(), b.float()  # [r, in], [n, r]
        w_sq = self._norms_sq(layer, group)[row: row + n]  # [n]
        wa = torch.cat([block @ a32.t() for block in _blocks(weight, row, row + n)])  # [n, r] = W A^T
        cross = (wa * b32).sum(1)  # [n]: (W A^T)_j . B_j
        ba_sq = ((b32 @ (a32 @ a32.t())) * b32).sum(1)  # [n]: ||(B A)_j||^2
        norm_sq = w_sq + (2 * scaling) * cross + (scaling * scaling) * ba_sq  # [n]
        norms = norm_sq.clamp(min=0).sqrt()
        cancelled = (norm_sq < CANCELLATION * w_sq).nonzero().squeeze(1)  # [k] rows to recompute
        if cancelled.numel():
            norms[cancelled] = _exact_norms(weight, cancelled + row, b32.index_select(0, cancelled), a32, scaling)
        out.copy_(torch.where(norms > 0, magnitude / norms, torch.zeros_like(norms)))

    def _norms_sq(self, layer: int, group: str) -> torch.Tensor:
        """||W_j||^2 of every row of the fused weight, [sum n_i] float32; computed once per base weight."""
        key = (layer, group)
        if key not in self._row_norms_sq:
            weight = self.weights[layer][group]
            self._row_norms_sq[key] = torch.cat([block.pow(2).sum(1) for block in _blocks(weight, 0, weight.shape[0])])
        return self._row_norms_sq[key]


def _exact_norms(weight: torch.Tensor | Int8Weight, rows_idx: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """||W_j + scaling * (B A)_j|| as PEFT computes it (materialised), for the weight rows rows_idx.

    Shape: rows_idx [k] int64; b [k, r] float32 (those rows' B); a [r, in] float32; returns [k] float32.
    """
    step = max(1, BLOCK_ELEMENTS // a.shape[1])
    out = []
    for lo in range(0, rows_idx.numel(), step):
        idx = rows_idx[lo: lo + step]
        w = _gather_rows(weight, idx)  # [k', in] float32
        out.append(torch.linalg.norm(w + scaling * (b[lo: lo + step] @ a), dim=1))
    return torch.cat(out)


def _blocks(weight: torch.Tensor | Int8Weight, lo: int, hi: int):
    """Rows lo..hi of the served weight as float32, a bounded block of rows at a time."""
    step = max(1, BLOCK_ELEMENTS // weight.shape[1])
    for start in range(lo, hi, step):
        yield _rows(weight, start, min(hi, start + step))


def _rows(weight: torch.Tensor | Int8Weight, lo: int, hi: int) -> torch.Tensor:
    """Rows lo..hi of the served weight, as float32 (a quantized weight dequantized: q * scale, or
    scale * q + offset for int4)."""
    if isinstance(weight, Int4Weight):
        return rows_int4(weight, torch.arange(lo, hi, device=weight.qweight.device))
    if isinstance(weight, (Int8Weight, Fp8Weight)):
        return weight.qweight[lo:hi].float() * weight.scale[lo:hi, None].float()
    return weight[lo:hi].float()


def _gather_rows(weight: torch.Tensor | Int8Weight, idx: torch.Tensor) -> torch.Tensor:
    """The served weight's rows idx, as float32."""
    if isinstance(weight, Int4Weight):
        return rows_int4(weight, idx)
    if isinstance(weight, (Int8Weight, Fp8Weight)):
        return weight.qweight.index_select(0, idx).float() * weight.scale.index_select(0, idx)[:, None].float()
    return weight.index_select(0, idx).float()
