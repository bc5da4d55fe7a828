"""How often each token occurs in a choice's output, kept up to date a token at a time.

The penalties (server.engine.sampler) read a penalised choice's output counts every step. Rebuilt
from the whole output each step, one request with a long output made every step of the batch, and
so every neighbour's next token, pay for its whole history again (and a repetition penalty for its
whole prompt). Counted incrementally, each output token is counted once over the choice's life, and
a step's penalty work for a row is its number of distinct tokens (at most the vocabulary), whatever
the history's length.
"""
from __future__ import annotations

from collections.abc import Sequence


class TokenCounts:
    """Counts of tokens[start:] of a list that only grows (a sequence's prompt + output ids)."""

    __slots__ = ("counts", "_start", "_seen", "counted")

    def __init__(self, start: int) -> None:
        self.counts: dict[int, int] = {}
        self._start = start  # where the output begins in the list
        self._seen = start  # the list's length when last caught up
        self.counted = 0  # tokens counted over this object's life: each output token once

    def caught_up(self, tokens: Sequence[int]) -> dict[int, int]:
        """The counts of tokens[start:], counting only what was appended since the last call."""
        counts = self.counts
        for i in range(self._seen, len(tokens)):
            token = tokens[i]
            counts[token] = counts.get(token, 0) + 1
        self.counted += len(tokens) - self._seen
        self._seen = len(tokens)
        return counts
