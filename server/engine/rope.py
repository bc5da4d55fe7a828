"""Rotary position embeddings, matching transformers' (default, linear, llama3, yarn)."""
from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
    assert kind == "llama3", kind
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters, op for op): interpolated frequencies below a
    ramp over the dimensions, original ones above it."""
    factor = float(scaling["factor"])
    old_len = scaling["original_max_position_embeddings"]  # ModelConfig fills it in when absent
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature, 1 elsewhere."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]))
    return mscale()


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, built once."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling, dtype, device) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        factor = attention_factor(scaling)
        self.cos = (emb.cos() * factor).to(dtype=dtype, device=device)  # [P, D]
        # rotate_half(x) * sin = cat(-x2, x1) * sin = cat(x2, x1) * cat(-sin1, sin2): the sign moves
        # into the table (exact: negation commutes with rounding), one op less per call.
        half = head_dim // 2
        sin = emb.sin() * factor
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype=dtype, device=device)  # [P, D]

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's rows of the tables, gathered once for all its layers: (cos, signed sin), each
        [T, 1, D], from positions [T]."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.signed_sin.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, H, D]; tables: from tables() for the step's positions."""
        cos, sin = tables
        half = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
