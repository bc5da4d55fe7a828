"""The structured-output token mask of a step: one bitmask for the whole batch, gathered from the
rows its constrained choices had filled ahead (server.engine.mask_lane), applied to the logits on
their device. Nothing is filled here: the step never waits on a grammar.

A row without a constraint keeps every bit set, so applying the mask leaves its logits
exactly as they were: unconstrained requests sample the same tokens whether or not a
constrained one shares their batch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from server.engine.mask_lane import LaneMatcher


class GrammarMask:
    """Owned by the model runner.

    `vocab_size` is the grammar tokenizer's width (server.engine.grammar.tokenizer_info), at
    least the logits' width; the mask is applied to the logits' width.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def gather(self, matchers: Sequence[LaneMatcher | None]) -> torch.Tensor | None:
        """[N, ceil(V / 32)] int32 on the CPU, bit t of row i set when row i may take token t;
        None when no row is constrained (the batch pays nothing). Every matcher's mask is ready
        (the scheduler ran only those)."""
        indices = [i for i, m in enumerate(matchers) if m is not None]
        if not indices:
            return None
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # every bit set
        for i in indices:
            bitmask[i] = matchers[i].row()[0]
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
