"""The logit modifications that come before temperature, in vLLM's order: logit_bias, then
min_tokens masking of EOS and stop ids, then repetition, presence and frequency penalties.

One step builds, once, flat index tensors of just the rows that use each
modification; a batch where no row uses any builds nothing at all. Each
touches only the (row, token) pairs it concerns: the biased tokens, the held
back stop tokens, the tokens a row has seen; never a whole [N, V] pass. The
functions below are the definitions, on plain tensors, so tests can hold
them against a reference.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
import torch

from server.engine.sampling_row import SamplingRow

_FLOAT32_MAX = torch.finfo(torch.float32).max


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, bias: torch.Tensor) -> None:
    """logits[rows[j], tokens[j]] += bias[j], in place; each (row, token) at most once.
    logits: [N, V]; rows, tokens, bias: [B]."""
    # Kept finite: a logit near float32's limit plus 100 must not become inf (inf - inf is NaN).
    logits.index_put_((rows, tokens), (logits[rows, tokens] + bias).clamp_(-_FLOAT32_MAX, _FLOAT32_MAX))


def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """logits[rows[j], tokens[j]] = -inf, in place: those tokens cannot be chosen."""
    logits.index_put_((rows, tokens), torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: torch.Tensor, output: tuple[torch.Tensor, torch.Tensor],
                    prompt: tuple[torch.Tensor, torch.Tensor] | None, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor,
                    output_counts: torch.Tensor | None = None) -> None:
    """In place on logits [N, V] (contiguous), touching only the tokens each row has seen:

    - repetition (vLLM's, from CTRL): a token in the prompt or the output has its logit divided
      by the row's penalty when positive, multiplied by it otherwise;
    - then presence and frequency (OpenAI's): logit -= presence * (count > 0) + frequency * count,
      counts over the output so far.

    output, prompt: (row, token) pairs [L] each, one per token (repeats count), or with
    `output_counts` [L] each output pair once with its count; the prompt may be left out when every
    row's repetition penalty is 1. presence, frequency, repetition: [N].
    """
    vocab = logits.shape[1]
    if output_counts is None:
        keys, counts = torch.unique(output[0] * vocab + output[1], return_counts=True)  # [K] sorted, [K]
    else:
        keys, order = torch.sort(output[0] * vocab + output[1])
        counts = output_counts[order]
    if prompt is not None:
        seen = torch.unique(torch.cat([keys, prompt[0] * vocab + prompt[1]]))  # [S] sorted, a superset
        if len(keys):
            at = torch.searchsorted(keys, seen).clamp_(max=len(keys) - 1)  # [S]
            counts = torch.where(keys[at] == seen, counts[at], 0)
        else:
            counts = torch.zeros_like(seen)
        keys = seen
    rows = keys // vocab
    flat = logits.view(-1)
    values = flat[keys]
    factor = repetition[rows]
    values = torch.where(values > 0, values / factor, values * factor)
    counts = counts.to(values.dtype)
    values = values - frequency[rows] * counts - presence[rows] * (counts > 0)
    # A tiny repetition penalty can divide a logit past float32's range: keep the ranking finite
    # (-inf stays -inf: a masked token stays masked).
    flat[keys] = values.clamp_(max=_FLOAT32_MAX)


@dataclass(frozen=True)
class _Penalties:
    presence: torch.Tensor  # [N] per batch row, 0 where unused
    frequency: torch.Tensor  # [N]
    repetition: torch.Tensor  # [N], 1 where unused
    output: tuple[torch.Tensor, torch.Tensor]  # (row, token), one pair per distinct output token of a penalised row
    output_counts: torch.Tensor  # [len(output[0])]: how often each pair's token occurs in its row's output
    prompt: tuple[torch.Tensor, torch.Tensor] | None  # the same for prompts, of rows whose repetition is not 1


@dataclass(frozen=True)
class LogitsProcessors:
    """One step's pre-temperature modifications, as flat per-row tensors."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, tokens, values)
    masked: tuple[torch.Tensor, torch.Tensor] | None  # (rows, tokens) held back by min_tokens
    penalties: _Penalties | None

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], device: torch.device,
              ending: frozenset[int] = frozenset()) -> LogitsProcessors | None:
        """None when no row uses any modification (the fast path: nothing is built or copied).
        `ending`: rows whose grammar allows only stop tokens now; min_tokens does not hold those
        back (vLLM's rule, vllm#54218: otherwise the row would have no token left)."""
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        mask_rows: list[int] = []
        mask_tokens_: list[int] = []
        penalised: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_tokens += p.logit_bias.keys()
                bias_values += p.logit_bias.values()
            if row.output_index < p.min_tokens and row.stop_ids and i not in ending:
                mask_rows += [i] * len(row.stop_ids)
                mask_tokens_ += row.stop_ids
            if p.has_penalties:
                penalised.append(i)
        if not (bias_rows or mask_rows or penalised):
            return None

        def ids(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

        bias = None
        if bias_rows:
            values = torch.tensor(bias_values, dtype=torch.float32).to(device, non_blocking=True)
            bias = (ids(bias_rows), ids(bias_tokens), values)
        masked = (ids(mask_rows), ids(mask_tokens_)) if mask_rows else None
        penalties = _build_penalties(rows, penalised, device) if penalised else None
        return cls(bias, masked, penalties)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Modify `logits` [N, V] (a private copy) in place; returns it."""
        if self.bias is not None:
            apply_logit_bias(logits, *self.bias)
        if self.masked is not None:
            mask_tokens(logits, *self.masked)
        pen = self.penalties
        if pen is not None:
            apply_penalties(logits, pen.output, pen.prompt, pen.presence, pen.frequency, pen.repetition,
                            pen.output_counts)
        return logits


def _build_penalties(rows: Sequence[SamplingRow], penalised: list[int], device: torch.device) -> _Penalties:
    def per_row(name: str, default: float) -> torch.Tensor:
        values = [default] * len(rows)
        for i in penalised:
            values[i] = getattr(rows[i].params, name)
        return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

    def pairs(owners: list[int], lengths: list[int], tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.repeat_interleave(torch.tensor(owners), torch.tensor(lengths)).to(device, non_blocking=True),
                tokens.to(device, non_blocking=True))

    # Each row's output as distinct tokens and counts (kept incrementally: server.engine.token_counts),
    # so a row's work here is its distinct tokens, never its whole history.
    counts = [rows[i].output_counts for i in penalised]
    output = pairs(penalised, [len(c) for c in counts],
                   torch.tensor(list(itertools.chain.from_iterable(c.keys() for c in counts)), dtype=torch.long))
    output_counts = torch.tensor(list(itertools.chain.from_iterable(c.values() for c in counts)),
                                 dtype=torch.long).to(device, non_blocking=True)
    # Only rows whose repetition penalty is not 1 read their prompt: for the others it changes nothing.
    prompts = [i for i in penalised if rows[i].params.repetition_penalty != 1.0 and rows[i].prompt_ids is not None]
    prompt = None
    if prompts:
        prompt = pairs(prompts, [len(rows[i].prompt_ids) for i in prompts], torch.cat([rows[i].prompt_ids for i in prompts]))
    return _Penalties(per_row("presence_penalty", 0.0), per_row("frequency_penalty", 0.0),
                      per_row("repetition_penalty", 1.0), output, output_counts, prompt)
