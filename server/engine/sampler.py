"""Next-token choice for a batch of rows, vectorised over the batch: the logit modifications
(LogitsProcessors), the truncation of a sampled row's distribution (truncate), and the draw (Sampler).

vLLM's order: logit_bias, min_tokens masking, penalties (LogitsProcessors); greedy
rows take the argmax there; sampled rows go on with temperature, top_k, top_p
and min_p (truncate), then draw (a seeded row with its own generator).
A structured-output constraint's
bitmask comes first (GrammarMask, grammar.py). Logprobs are of the raw logits. A batch whose rows use none of these pays for
none of them.

Numerically safe for every value SamplingParams accepts: temperatures below
SAMPLING_EPS are greedy, logits are shifted so their maximum is 0 before the
temperature divides them (the quotient cannot overflow), and top-p always
keeps the top token. A row whose logits are not finite (a broken adapter)
gets a SampleFailure instead of a token, so only its own request fails.

The logit modifications (LogitsProcessors) that come before temperature, in vLLM's order: logit_bias, then
min_tokens masking of EOS and stop ids, then repetition, presence and frequency penalties.

One step builds, once, flat index tensors of just the rows that use each
modification; a batch where no row uses any builds nothing at all. Each
touches only the (row, token) pairs it concerns: the biased tokens, the held
back stop tokens, the tokens a row has seen; never a whole [N, V] pass. The
functions below are the definitions, on plain tensors, so tests can hold
them against a reference.

Which tokens a sampled row may draw (truncate), and with what weight: temperature, then top_k, top_p, min_p.

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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from server.engine.grammar import GrammarMask
from server.engine.logprobs import gather_logprobs
from server.engine.row_max import row_max
from server.engine.sampling_row import SamplingRow
from server.engine.sequence import SamplingParams, TokenLogprobs


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
    # Every row the argmax of its raw logits (the usual greedy batch): nothing per row to read beyond this.
    if bitmask is None and all(row.params.plain_greedy for row in rows):
        return _plain_greedy(logits)
    ending = frozenset() if bitmask is None else _grammar_ending(rows, grammar_mask, bitmask)
    processors = LogitsProcessors.build(rows, logits.device, ending)
    if processors is None and bitmask is None:
        processed = logits  # [N, V]
        best, chosen = row_max(logits)  # [N] each; the first index of ties, as argmax
        raw_max = best
    else:
        raw_max = logits.amax(dim=-1)
        processed = logits.clone()  # the raw logits stay for logprobs
        if bitmask is not None:
            assert grammar_mask is not None
            grammar_mask.apply(processed, bitmask)
        if processors is not None:
            processed = processors.apply(processed)
        best, chosen = row_max(processed)
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


def _plain_greedy(logits: torch.Tensor) -> SamplerOutput:
    """sample_rows for a batch of plain greedy rows: each row's first argmax, or its failure where a logit
    is not finite (NaN or +-inf, as the general path's max and min find them)."""
    best, chosen = row_max(logits)
    tokens: list[int | SampleFailure] = chosen.tolist()
    # Every logit finite (the usual batch), told by one scalar: a NaN or +inf shows in its row's max, a -inf
    # in the min. A sum that overflows only sends the batch to the exact per-row check.
    if not torch.isfinite(best.sum() + logits.amin()):
        finite = (torch.isfinite(best) & (logits.amin(dim=-1) > float("-inf"))).tolist()
        for i, ok in enumerate(finite):
            if not ok:
                tokens[i] = SampleFailure("produced non-finite logits", non_finite=True)
    return SamplerOutput(tokens, [None] * len(tokens))


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
