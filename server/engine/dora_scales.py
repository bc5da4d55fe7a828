"""DoRA's per-output scale g = m / ||W + scaling * B @ A||, computed against the served base weights.

PEFT (0.21, tuners/lora/dora.py, in eval mode) adds to a DoRA module's base output
    (g - 1) * (x W^T) + g * scaling * B(A(x)),   g = m / ||W + scaling * B @ A|| per output row,
the norm taken over each row of the [out, in] weight (fan_in_fan_out is False for nn.Linear),
detached, with B @ A and the sum in the weight's dtype. So the module computes
    g * (x W^T + scaling * x A^T B^T) + bias:
the plain LoRA output, bias aside, scaled per output column by g, which depends on the adapter and the
base weights only. It is computed once, when the adapter enters a device slot (server.engine.lora_slots),
exactly as PEFT computes it (the sum materialised, then its row norms), a bounded block of rows at a
time so no [out, in] temporary of a large projection is ever allocated whole; the forward applies it
as one gathered multiply (kernels.dora_scale).

A row whose W + scaling * B @ A is all zeros gives PEFT m / 0 (inf, or NaN); its output x (W + sBA)^T is
exactly 0 whatever g, so g is 0 there: the row serves 0 where PEFT would serve NaN.
"""
from __future__ import annotations

import torch

from kernels.int8_weights import Int8Weight

# Rows of W + scaling * B @ A materialised at a time: 4 Mi float32 (16 MiB) whatever the projection.
BLOCK_ELEMENTS = 4 << 20
# The model's attribute for each slot group (server.engine.lora_slots.PROJECTION_SLICES).
_GROUP_ATTRS = {"qkv": "qkv", "o": "o", "gate_up": "gate_up", "down": "down"}


class DoraScales:
    """Per layer, the fused base weight of each slot group, to compute DoRA scales against."""

    def __init__(self, weights: list[dict[str, torch.Tensor | Int8Weight]]) -> None:
        self.weights = weights  # per layer: group -> [sum n_i, in] fused weight (float, or int8 with row scales)

    @classmethod
    def of_model(cls, model) -> "DoraScales":
        """From a server.engine.model.CausalLM: the weights its LoraLinear layers serve."""
        return cls([{g: getattr(layer, attr).weight for g, attr in _GROUP_ATTRS.items()} for layer in model.layers])

    @torch.inference_mode()
    def compute(self, layer: int, group: str, row: int, a: torch.Tensor, b: torch.Tensor, scaling: float,
                magnitude: torch.Tensor, out: torch.Tensor) -> None:
        """Write g = m / ||W + scaling * B @ A|| (0 where the norm is 0) for one projection into `out`.

        Shape: a [r, in] and b [n, r] (the slot's, serving dtype); magnitude [n] float32; out [n] float32;
        the projection is rows row .. row + n of the layer's fused `group` weight [sum n_i, in].
        """
        weight = self.weights[layer][group]
        n, width = b.shape[0], a.shape[1]
        a32 = a.float()
        step = max(1, BLOCK_ELEMENTS // width)
        norms = torch.empty(n, dtype=torch.float32, device=out.device)  # [n]
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            lora_weight = b[lo:hi].float() @ a32  # [hi - lo, in]
            rows = _rows(weight, row + lo, row + hi)  # [hi - lo, in] float32
            norms[lo:hi] = torch.linalg.norm(rows + scaling * lora_weight, dim=1)
        out.copy_(torch.where(norms > 0, magnitude / norms, torch.zeros_like(norms)))


def _rows(weight: torch.Tensor | Int8Weight, lo: int, hi: int) -> torch.Tensor:
    """Rows lo..hi of the served weight, as float32 (an int8 weight dequantized: q * scale)."""
    if isinstance(weight, Int8Weight):
        return weight.qweight[lo:hi].float() * weight.scale[lo:hi, None].float()
    return weight[lo:hi].float()
