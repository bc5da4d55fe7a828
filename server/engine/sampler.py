"""Next-token choice for a batch of rows, vectorised over the batch.

vLLM's order: logit_bias, min_tokens masking, penalties (penalties.py); greedy
rows take the argmax there; sampled rows go on with temperature, top_k, top_p
and min_p (truncation.py), then draw (a seeded row with its own generator).
A structured-output constraint's
bitmask comes first (grammar_mask.py). Logprobs are of the raw logits. A batch whose rows use none of these pays for
none of them.

Numerically safe for every value SamplingParams accepts: temperatures below
SAMPLING_EPS are greedy, logits are shifted so their maximum is 0 before the
temperature divides them (the quotient cannot overflow), and top-p always
keeps the top token. A row whose logits are not finite (a broken adapter)
gets a SampleFailure instead of a token, so only its own request fails.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from server.engine.grammar_mask import GrammarMask
from server.engine.logprobs import gather_logprobs
from server.engine.penalties import LogitsProcessors
from server.engine.sampling_row import SamplingRow
from server.engine.sequence import TokenLogprobs
from server.engine.truncation import truncate

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs across the generator's seed space
_CHOICE_MIX = 0xBF58476D1CE4E5B9  # and choices: choice 0 keeps the n == 1 stream


@dataclass(frozen=True)
class SampleFailure:
    """Why a row got no token; the engine fails that row's request alone."""

    reason: str
    non_finite: bool = False  # the model (with the row's adapter) produced NaN/inf logits


def _grammar_ending(rows: Sequence[SamplingRow], grammar_mask: GrammarMask, bitmask: torch.Tensor) -> frozenset[int]:
    """Rows held back by min_tokens whose grammar allows nothing but their stop tokens now."""
    return frozenset(i for i, row in enumerate(rows)
                     if row.grammar is not None and row.stop_ids and row.output_index < row.params.min_tokens
                     and grammar_mask.allows_only(bitmask, i, row.stop_ids))


@dataclass(frozen=True)
class SamplerOutput:
    tokens: list[int | SampleFailure]  # per row
    logprobs: list[TokenLogprobs | None]  # per row; None unless asked for (or the row failed)


def sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow], engine_generator: torch.Generator,
                grammar_mask: GrammarMask | None = None, bitmask: torch.Tensor | None = None) -> SamplerOutput:
    """logits: [N, V] float32, one row per SamplingRow; bitmask: [N, W] int32 from
    grammar_mask.gather (None: no row is constrained), applied before any other modification.

    A seeded row's draw depends only on (seed, choice, output index) and its own
    logits, so the same seed gives the same tokens whatever shares the batch,
    and a request resumed after preemption continues exactly.
    """
    ending = frozenset() if bitmask is None else _grammar_ending(rows, grammar_mask, bitmask)
    processors = LogitsProcessors.build(rows, logits.device, ending)
    if processors is None and bitmask is None:
        processed = logits  # [N, V]
        best, chosen = logits.max(dim=-1)  # [N] each; the first index of ties, as argmax
        raw_max = best
    else:
        raw_max = logits.amax(dim=-1)
        processed = logits.clone()  # the raw logits stay for logprobs
        if bitmask is not None:
            assert grammar_mask is not None
            grammar_mask.apply(processed, bitmask)
        if processors is not None:
            processed = processors.apply(processed)
        best, chosen = processed.max(dim=-1)
    # max propagates NaN and shows +inf, min shows -inf: two reductions instead of an [N, V] mask.
    finite = torch.isfinite(raw_max) & (logits.amin(dim=-1) > float("-inf"))  # [N]
    # Only a finite row can lose every token (a penalty overflow), and then it fails alone.
    usable = (finite & (best > float("-inf"))).tolist()
    tokens: list[int | SampleFailure] = chosen.tolist()
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy and usable[i]]
    if sampled:
        for i, token in zip(sampled, _draw(processed, rows, sampled, engine_generator)):
            tokens[i] = token
    if not all(usable):
        finite_list = finite.tolist()
        for i in range(len(rows)):
            if not finite_list[i]:
                tokens[i] = SampleFailure("produced non-finite logits", non_finite=True)
            elif not usable[i]:
                tokens[i] = SampleFailure("the sampling parameters left no token to choose")
    return SamplerOutput(tokens, _logprobs(logits, rows, tokens))


def _draw(processed: torch.Tensor, rows: Sequence[SamplingRow], sampled: list[int],
          engine_generator: torch.Generator) -> list[int | SampleFailure]:
    """One draw for each sampled row of the modified logits `processed` [N, V], by inverting
    the row's cumulative weights at one uniform number: a seeded row's number comes from its
    own generator, the others' from the engine's, all at once."""
    params = [rows[i].params for i in sampled]
    sub = processed.index_select(0, torch.tensor(sampled, device=processed.device))  # [M, V]
    uniform = torch.empty(len(sampled))  # [M]
    unseeded = [j for j, p in enumerate(params) if p.seed is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), generator=engine_generator)
    for j, p in enumerate(params):
        if p.seed is not None:
            row = rows[sampled[j]]
            seed = (p.seed * _SEED_MIX + row.choice * _CHOICE_MIX + row.output_index) % (1 << 63)
            uniform[j] = torch.rand(1, generator=torch.Generator().manual_seed(seed))
    out: list[int | SampleFailure] = [SampleFailure("sampling gave an empty distribution")] * len(sampled)
    for group in truncate(sub, params):
        cumulative = group.weights.cumsum(dim=-1)  # [R, C]
        total = cumulative[:, -1:].contiguous()  # [R, 1]
        target = uniform.to(total.device)[group.rows][:, None] * total  # [R, 1]
        # The first column whose cumulative weight passes the target holds positive weight; a target
        # rounded up to the total takes the last column with weight (the first to reach the total).
        col = torch.minimum(torch.searchsorted(cumulative, target, right=True),
                            torch.searchsorted(cumulative, total))  # [R, 1]
        tokens = col if group.token_ids is None else group.token_ids.gather(1, col)
        valid = (torch.isfinite(total) & (total > 0)).squeeze(1).tolist()
        for j, token, ok in zip(group.rows, tokens.squeeze(1).tolist(), valid):
            if ok:
                out[j] = token
    return out


def _logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow],
              tokens: list[int | SampleFailure]) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None and isinstance(tokens[i], int)]
    if not wanted:
        return out
    device = logits.device
    sub = logits if len(wanted) == len(rows) else logits.index_select(0, torch.tensor(wanted, device=device))  # [W, V]
    targets = torch.tensor([tokens[i] for i in wanted], dtype=torch.long)
    for i, entry in zip(wanted, gather_logprobs(sub, targets, [rows[i].params.logprobs for i in wanted])):
        out[i] = entry
    return out
