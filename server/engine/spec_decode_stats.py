"""Speculative decoding's counters since start, vLLM's `spec_decode` metrics: verify steps run
(one per sequence and step that had drafts), drafts verified, drafts accepted (in all and by draft
position), and decode steps run without drafts because the batch was past the cut-off."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeStats:
    method: str | None = None  # None: speculative decoding is off
    num_drafts: int = 0  # vLLM's spec_decode_num_drafts: sequences' verify steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # [j]: verify steps that accepted draft j (0-based)
    skipped_steps: int = 0  # steps whose batch was too large to speculate (disable_by_batch_size)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step emits on average: its accepted drafts and the target's own (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecodeCounters:
    """The mutable side: the output processor counts verify steps, the scheduler skipped steps."""

    def __init__(self, method: str | None) -> None:
        self.method = method
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.skipped_steps = 0

    def verified(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.method, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               tuple(self.accepted_per_position), self.skipped_steps)
