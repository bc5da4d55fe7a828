"""The structured-output token mask of a step: one bitmask for the whole batch, filled by
xgrammar in one call, applied to the logits on their device.

A row without a constraint keeps every bit set, so applying the mask leaves its logits
exactly as they were: unconstrained requests sample the same tokens whether or not a
constrained one shares their batch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class GrammarMask:
    """Owned by the model runner: the batch matcher (its thread pool) lives across steps.

    The runner fills the mask after the forward call returns: on a GPU the forward's kernels are
    still running then, so the fill overlaps them; on a CPU the forward's own threads use every
    core, so a fill on a thread beside it (tried first) only competes with them.

    `vocab_size` is the grammar tokenizer's width (server.engine.grammar.tokenizer_info), at
    least the logits' width; the mask is applied to the logits' width.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._batch = xgr.BatchGrammarMatcher()

    def fill(self, matchers: Sequence[xgr.GrammarMatcher | None]) -> torch.Tensor | None:
        """[N, ceil(V / 32)] int32 on the CPU, bit t of row i set when row i may take token t;
        None when no row is constrained (the batch pays nothing)."""
        indices = [i for i, m in enumerate(matchers) if m is not None]
        if not indices:
            return None
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # every bit set
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in indices], bitmask, indices)
        return bitmask

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """logits: [N, V] (any device), changed in place: disallowed tokens become -inf."""
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=logits.shape[-1])

    def allows_only(self, bitmask: torch.Tensor, row: int, tokens: Sequence[int]) -> bool:
        """Whether row `row` of a filled bitmask allows no token outside `tokens` (its grammar can
        only end now, when `tokens` are the stop tokens)."""
        words = bitmask[row].to(torch.int64) & 0xFFFFFFFF  # [W] the row's 32-bit words, unsigned
        for t in tokens:
            if 0 <= t < self.vocab_size:
                words[t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF
        tail = self.vocab_size % 32
        if tail:  # bits past the vocabulary are no tokens
            words[-1] &= (1 << tail) - 1
        return not bool(words.any())
