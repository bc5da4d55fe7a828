"""Next-token choice per row: greedy rows in one argmax, sampled rows each with their own generator.

Numerically safe for every value SamplingParams accepts: temperatures below
SAMPLING_EPS are greedy, logits are shifted so their maximum is 0 before the
temperature divides them (the quotient cannot overflow), and top-p always
keeps the top token. A row whose logits are not finite (a broken adapter)
gets a SampleFailure instead of a token, so only its own request fails.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from server.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs across the generator's seed space


@dataclass(frozen=True)
class SampleFailure:
    """Why a row got no token; the engine fails that row's request alone."""

    reason: str
    non_finite: bool = False  # the model (with the row's adapter) produced NaN/inf logits


def sample(
    logits: torch.Tensor,  # [N, V] float32
    params: list[SamplingParams],
    output_indices: list[int],  # index in its request's output of the token being chosen
    engine_generator: torch.Generator,
) -> list[int | SampleFailure]:
    """Greedy rows take the argmax; sampled rows draw after temperature, top_k, top_p.

    A seeded request's draw depends only on (seed, output index) and its own
    logits, so the same seed gives the same tokens whatever shares the batch,
    and a request resumed after preemption continues exactly.
    """
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    out: list[int | SampleFailure] = logits.argmax(dim=-1).tolist()
    for row, (p, idx) in enumerate(zip(params, output_indices)):
        if not finite[row]:
            out[row] = SampleFailure("produced non-finite logits", non_finite=True)
            continue
        if p.greedy:
            continue
        if p.seed is not None:
            gen = torch.Generator(device="cpu").manual_seed((p.seed * _SEED_MIX + idx) % (1 << 63))
        else:
            gen = engine_generator
        try:
            probs = _filtered_probs(logits[row].cpu(), p)
            out[row] = int(torch.multinomial(probs, 1, generator=gen).item())
        except Exception as e:  # noqa: BLE001 - one request's failure, never the batch's
            log.exception("sampling failed for one row")
            out[row] = SampleFailure(f"sampling failed: {type(e).__name__}: {e}")
    return out


def _filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    # Shifted first: every quotient is <= 0, so even logits near float32's limit over a small
    # temperature cannot overflow to inf; the top logit maps to exactly 0, so its probability
    # is at least 1/V and nothing below can make the distribution empty.
    scaled = (row - row.max()) / p.temperature  # [V]
    if p.top_k and p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        # Ranked by the logits, not the probabilities: logits a denormal apart round to equal
        # probabilities, and the token kept first must be the greedy one (argmax: first of ties).
        order = row.sort(descending=True, stable=True).indices
        sorted_probs = probs.index_select(0, order)
        cumulative = sorted_probs.cumsum(0)
        # Keep the smallest prefix whose mass reaches top_p. The top token is kept explicitly:
        # a denormal top_p (1e-320) compared with a float32 tensor rounds to 0, and 0 >= 0.
        drop = cumulative - sorted_probs >= p.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    total = probs.sum()
    assert bool(torch.isfinite(probs).all()) and float(total) > 0, "a finite row gave an empty distribution"
    return probs / total
