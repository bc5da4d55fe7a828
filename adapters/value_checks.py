"""Bounds on an adapter's numbers, so that serving it cannot produce inf or NaN from the adapter alone.

The engine keeps A and B in the serving dtype and applies `scaling` to the
rank-space activations, so a single NaN weight, a weight beyond the dtype's
range or an absurd lora_alpha poisons every request on the adapter. The
narrowest serving dtype is float16 (largest finite value 65504; bfloat16 and
float32 reach further), and the rules are:

1. every element of lora_A and lora_B is finite and |x| <= 65504, so it is
   representable in any serving dtype;
2. |scaling| <= MAX_SCALING for every module (and, from the config alone,
   |alpha| <= MAX_SCALING * max_lora_rank, because scaling is alpha / r or
   alpha / sqrt(r) with 1 <= r <= max_lora_rank);
3. the delta weight scaling * B @ A is within float16's range element-wise:
   |dW_ij| <= |scaling| * sum_k max_i|B_ik| * max_j|A_kj| <= 65504. This is a
   sound bound (each term of the sum over k is bounded by those maxima) that
   costs O(r * (in + out)), and it is tighter than |scaling| * r * max|B| * max|A|.

4. every element of a DoRA magnitude vector is finite and |m| <= 65504. The
   scale the engine applies, m / ||W + scaling * B @ A|| per output row, then
   keeps each output row's length at |m| times the input's, whatever W.

Real adapters sit orders of magnitude inside all three: trained A/B entries
are ~1e-2, scalings are alpha/r ~ 0.5..32 (rsLoRA up to ~128), and deltas are
a fraction of the base weights (~1e-1). Activation-dependent overflow (a huge
input times a legal adapter) cannot be ruled out statically; those requests
fail on their own.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from adapters.peft_config import AdapterFormatError

FP16_MAX = 65504.0
# 100x the largest scaling in common use (rsLoRA alpha=128 at r=1): only a
# broken or hostile config gets near it.
MAX_SCALING = 1e4


def check_config_alphas(cfg: Mapping[str, Any], max_lora_rank: int, source: str) -> None:
    """lora_alpha and every alpha_pattern value, including ones no module ends up using."""
    bound = MAX_SCALING * max_lora_rank
    values = [("lora_alpha", cfg.get("lora_alpha", 8))]
    values += [(f"alpha_pattern[{key!r}]", v) for key, v in (cfg.get("alpha_pattern") or {}).items()]
    for field, alpha in values:
        if abs(alpha) > bound:
            raise AdapterFormatError(
                f"{source}: {field} = {alpha!r} is above {bound:g} in magnitude: with ranks up to max_lora_rank "
                f"{max_lora_rank}, no module could get a scaling within +-{MAX_SCALING:g}")


def check_scaling(name: str, scaling: float, alpha: float, rank: int, use_rslora: bool, source: str) -> None:
    if not (math.isfinite(scaling) and abs(scaling) <= MAX_SCALING):
        divisor = f"sqrt({rank})" if use_rslora else str(rank)
        raise AdapterFormatError(
            f"{source}: {name}: scaling {scaling!r} (lora_alpha {alpha!r} / {divisor}) is beyond "
            f"+-{MAX_SCALING:g}; such an adapter would overflow the serving dtype")


def check_magnitude(name: str, magnitude: torch.Tensor, source: str) -> None:
    """magnitude: [out] float32, DoRA's lora_magnitude_vector as materialised."""
    bad = ~torch.isfinite(magnitude)
    if bad.any():
        raise AdapterFormatError(f"{source}: {name}: lora_magnitude_vector holds {magnitude[bad][0].item()!r}; "
                                 "every value must be finite")
    peak = magnitude.abs().max().item()
    if peak > FP16_MAX:
        raise AdapterFormatError(f"{source}: {name}: lora_magnitude_vector holds a value of magnitude {peak:g}, "
                                 f"beyond {FP16_MAX:g} (the largest float16)")


def check_weights(name: str, a: torch.Tensor, b: torch.Tensor, scaling: float, source: str) -> None:
    """a: [r, in], b: [out, r], both float32 as materialised."""
    for part, t in (("lora_A", a), ("lora_B", b)):
        bad = ~torch.isfinite(t)
        if bad.any():
            value = t[bad][0].item()
            raise AdapterFormatError(f"{source}: {name}: {part} holds {value!r}; every weight must be finite")
        peak = t.abs().max().item()
        if peak > FP16_MAX:
            raise AdapterFormatError(f"{source}: {name}: {part} holds a weight of magnitude {peak:g}, beyond "
                                     f"{FP16_MAX:g} (the largest float16) so it cannot be served in float16")
    # float64: 65504^2 * r * MAX_SCALING stays exact enough and far from overflow.
    b_peak = b.abs().amax(dim=0).double()       # [r]: max_i |B_ik|
    a_peak = a.abs().amax(dim=1).double()       # [r]: max_j |A_kj|
    delta = abs(scaling) * float(torch.dot(b_peak, a_peak))
    if delta > FP16_MAX:
        raise AdapterFormatError(
            f"{source}: {name}: the delta weight scaling * B @ A can reach {delta:g} (scaling {scaling:g}), "
            f"beyond {FP16_MAX:g} (the largest float16)")
