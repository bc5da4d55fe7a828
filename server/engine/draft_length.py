"""How many drafts one sequence proposes next (speculative decoding's adaptive k).

Each rejected draft costs a position in the verify step; an accepted one saves a whole step. So k
follows the sequence's acceptance: every verify step that accepts all its drafts lets k grow by one
(up to the configured k), one that rejects some sets k to the accepted run plus one. A sequence whose
drafts keep failing at k = 1 rests: after m verify steps in a row that accepted nothing, it proposes
nothing for 2**(m-1) - 1 decode steps (at most MAX_REST), so a request in its own words pays almost
nothing for speculation, and one that starts quoting again gets its drafts back within a few steps.
"""
from __future__ import annotations

MAX_REST = 32  # decode steps a sequence may go without proposing


class DraftLength:
    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.k = k_max  # start optimistic: a miss costs one step's k positions, then k drops
        self.misses = 0  # verify steps in a row that accepted nothing
        self.rest = 0  # decode steps left without drafts

    def next_k(self) -> int:
        """Drafts to propose this decode step (0 while resting)."""
        if self.rest:
            self.rest -= 1
            return 0
        return self.k

    def peek(self) -> int:
        """What next_k() will return, without counting down a rest."""
        return 0 if self.rest else self.k

    def verified(self, drafted: int, accepted: int) -> None:
        self.k, self.misses, self.rest = self._after(drafted, accepted)

    def k_after(self, drafted: int, accepted: int) -> int:
        """What next_k() will return once this step's outcome is in (drafted 0: the step verified none),
        without changing anything: Medusa heads draft only that many for the next step."""
        k, _, rest = self._after(drafted, accepted) if drafted else (self.k, self.misses, self.rest)
        return 0 if rest else k

    def _after(self, drafted: int, accepted: int) -> tuple[int, int, int]:
        """(k, misses, rest) after a verify step of `drafted` drafts that accepted `accepted`."""
        k = min(self.k_max, self.k + 1) if accepted == drafted else accepted + 1
        if accepted:
            return k, 0, self.rest
        misses = self.misses + 1
        return k, misses, min(MAX_REST, 2 ** (misses - 1) - 1) if k == 1 else self.rest
