"""Rotary position embeddings, matching transformers' Llama (default, linear, llama3)."""
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


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, built once."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling, dtype, device) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos().to(dtype=dtype, device=device)  # [P, D]
        # rotate_half(x) * sin = cat(-x2, x1) * sin = cat(x2, x1) * cat(-sin1, sin2): the sign moves
        # into the table (exact: negation commutes with rounding), one op less per call.
        half = head_dim // 2
        sin = emb.sin()
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
