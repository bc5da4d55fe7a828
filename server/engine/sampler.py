"""Next-token choice per row: greedy rows in one argmax, sampled rows each with their own generator."""
from __future__ import annotations

import torch

from server.engine.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs across the generator's seed space


def sample(
    logits: torch.Tensor,  # [N, V] float32
    params: list[SamplingParams],
    output_indices: list[int],  # index in its request's output of the token being chosen
    engine_generator: torch.Generator,
) -> list[int]:
    """Greedy rows take the argmax; sampled rows draw after temperature, top_k, top_p.

    A seeded request's draw depends only on (seed, output index) and its own
    logits, so the same seed gives the same tokens whatever shares the batch,
    and a request resumed after preemption continues exactly.
    """
    out = logits.argmax(dim=-1).tolist()
    for row, (p, idx) in enumerate(zip(params, output_indices)):
        if p.greedy:
            continue
        if p.seed is not None:
            gen = torch.Generator(device="cpu").manual_seed((p.seed * _SEED_MIX + idx) % (1 << 63))
        else:
            gen = engine_generator
        probs = _filtered_probs(logits[row].cpu(), p)
        out[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out


def _filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scaled = row / p.temperature  # [V]
    if p.top_k and p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = cumulative - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs / probs.sum()
