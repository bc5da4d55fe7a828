"""Which tokens a sampled row may draw, and with what weight: temperature, then top_k, top_p, min_p.

Ranking a whole vocabulary (sorting 128k logits per row) is what top_k and
top_p cost, while a row's nucleus is usually a few dozen tokens. So a row
ranks only its CANDIDATES[0] most likely tokens when that provably gives the
same answer: when top_k is no wider, or when those tokens hold at least top_p
of the probability (every token outside them has at least that much ranked
above it, so top_p drops it anyway); else the next, wider, width; the whole
vocabulary last. Kept tokens are a prefix of the same ranking (logit, then
token id) at every width, so the width a row needs changes nothing in what
it draws; and it depends on that row alone, never on its batch neighbours.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from server.engine.sampling_params import SamplingParams

CANDIDATES = (256, 4096)


@dataclass(frozen=True)
class RowWeights:
    """Sampling weights (not normalised) of some rows, columns in a per-row order of their own."""

    rows: list[int]  # positions of these rows among the rows asked for
    weights: torch.Tensor  # [R, C]
    token_ids: torch.Tensor | None  # [R, C] token of each column; None: column c is token c (C = V)


def truncate(logits: torch.Tensor, params: Sequence[SamplingParams],
             candidates: Sequence[int] | None = None) -> list[RowWeights]:
    """logits: [M, V] (after bias and penalties), one row per params; `candidates` defaults to CANDIDATES."""
    vocab = logits.shape[1]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)  # [M]
    # Shifted first: every quotient is <= 0, so even logits near float32's limit over a small
    # temperature cannot overflow to inf; the top logit maps to exactly 0.
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature[:, None]  # [M, V]
    ranked = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    plain = [j for j, p in enumerate(params) if not (0 < p.top_k < vocab or p.top_p < 1.0)]
    groups = []
    if plain:
        groups.append(RowWeights(plain, torch.softmax(_rows(scaled, plain), dim=-1), None))
    for width in (*(candidates or CANDIDATES), vocab):
        if not ranked:
            break
        width = min(width, vocab)
        weights, ids, covered = _rank(_rows(logits, ranked), _rows(scaled, ranked), [params[j] for j in ranked],
                                      width)
        done = [i for i, c in enumerate(covered) if c]
        if done:
            groups.append(RowWeights([ranked[i] for i in done], _rows(weights, done), _rows(ids, done)))
        ranked = [ranked[i] for i, c in enumerate(covered) if not c]
    if any(p.min_p > 0.0 for p in params):
        groups = [_min_p(g, params) for g in groups]
    return groups


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams],
                   candidates: Sequence[int] | None = None) -> torch.Tensor:
    """The same weights laid out over the vocabulary: [M, V] (not normalised)."""
    dense = torch.zeros_like(logits)
    for g in truncate(logits, params, candidates):
        rows = torch.tensor(g.rows, device=logits.device)
        if g.token_ids is None:
            dense[rows] = g.weights
        else:
            dense[rows] = torch.zeros_like(dense[rows]).scatter_(1, g.token_ids, g.weights)
    return dense


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return t if len(rows) == t.shape[0] else t.index_select(0, torch.tensor(rows, device=t.device))


def _rank(logits: torch.Tensor, scaled: torch.Tensor, params: list[SamplingParams],
          width: int) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """top_k and top_p over each row's `width` most likely tokens.

    logits, scaled: [R, V]. Returns weights [R, width], their token ids [R, width] and, per row,
    whether those tokens cover everything top_k and top_p keep (always, at width V).
    """
    rows, vocab = logits.shape
    device = logits.device
    if width < vocab:
        ids = logits.topk(width, dim=-1, sorted=False).indices.sort(dim=-1).values  # [R, W] ascending ids
    else:
        ids = torch.arange(vocab, device=device).expand(rows, vocab)
    # Ranked by logit, ties by token id (a stable sort of ascending ids): the first is argmax's token,
    # ranked by the logits before the temperature, which can make logits a denormal apart equal.
    order = logits.gather(1, ids).sort(dim=-1, descending=True, stable=True).indices
    ids = ids.gather(1, order)  # [R, W]
    ranked = scaled.gather(1, ids)  # [R, W], descending
    has_k = [0 < p.top_k < vocab for p in params]
    if any(has_k):
        # A row without top_k takes the last ranked value as its k-th: nothing ranks below it.
        k = [min(p.top_k, width) if h else width for p, h in zip(params, has_k)]
        kth = ranked.gather(1, torch.tensor(k, device=device)[:, None] - 1)  # [R, 1]
        ranked = ranked.masked_fill(ranked < kth, float("-inf"))
    lse = torch.logsumexp(ranked, dim=-1)  # [R]
    if width < vocab and not all(has_k):
        # Without top_k the distribution spans the whole vocabulary: normalise over it.
        lse = torch.where(torch.tensor(has_k, device=device), lse, torch.logsumexp(scaled, dim=-1))
    probs = torch.exp(ranked - lse[:, None])  # [R, W]
    reached = [False] * rows
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)  # [R]
        cumulative = probs.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p. The top token is kept explicitly:
        # a denormal top_p (1e-320) rounds to 0 in float32, and 0 >= 0.
        drop = cumulative - probs >= top_p[:, None]
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
        reached = (cumulative[:, -1] >= top_p).tolist()
    if width == vocab:
        return probs, ids, [True] * rows
    # top_k within the ranked tokens keeps only them; without top_k, reaching top_p within them
    # drops every other token. A top_k wider than them needs the whole vocabulary ranked.
    covered = [(h and p.top_k <= width) or (not h and r) for p, h, r in zip(params, has_k, reached)]
    return probs, ids, covered


def _min_p(g: RowWeights, params: Sequence[SamplingParams]) -> RowWeights:
    """vLLM: drop tokens below min_p times the row's top probability (a ratio: unchanged by
    normalisation, and the top token is always among the row's weights)."""
    min_p = torch.tensor([params[j].min_p for j in g.rows], device=g.weights.device)  # [R]
    top = g.weights.max(dim=-1, keepdim=True).values  # [R, 1]
    return RowWeights(g.rows, g.weights.masked_fill(g.weights < min_p[:, None] * top, 0.0), g.token_ids)
