"""What a prompt chunk costs a step, in decode-token equivalents, for the prefill cap while others decode.

A chunk's tokens are not equal: each attends over every position before it, and a position whose prompt
logprobs are asked for also runs the lm_head and a log-softmax over the vocabulary. Late in a long
prompt, and with prompt logprobs, a 256-token chunk costs several times 256 ordinary tokens, and every
decoding stream waits for it. Counted here from the model's shape (multiply-adds relative to one
token's projections and MLP), so the cap bounds a step's work, not only its token count, and stays
deterministic (a measured cost would make the schedule depend on the machine's load).
"""
from __future__ import annotations

from dataclasses import dataclass

from server.engine.config import ModelConfig
from server.engine.sequence import Sequence


@dataclass(frozen=True)
class StepCost:
    attention_per_position: float = 0.0  # one query token attending one earlier position
    logits_row: float = 0.0  # one prompt position's logits (lm_head), for its prompt logprobs
    # Every layer windowed (ModelConfig.kv_window): a token attends at most this many positions.
    window: int | None = None

    def __post_init__(self) -> None:
        assert self.attention_per_position >= 0 and self.logits_row >= 0

    @classmethod
    def of(cls, mcfg: ModelConfig) -> StepCost:
        q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
        per_layer = mcfg.hidden_size * (2 * q + 2 * kv + 3 * mcfg.intermediate_size)  # q, k, v, o, gate/up/down
        return cls(attention_per_position=2 * q / per_layer,  # QK^T and PV, per layer like the projections
                   logits_row=mcfg.hidden_size * mcfg.vocab_size / (mcfg.num_layers * per_layer),
                   window=mcfg.kv_window)

    @property
    def plain(self) -> bool:
        return not (self.attention_per_position or self.logits_row)

    def chunk(self, seq: Sequence, start: int, n: int) -> float:
        """Cost of computing `seq`'s tokens start..start+n."""
        if self.plain:
            return float(n)
        attended = _attended(start + 1, start + n, self.window)  # token i attends start + i + 1 positions
        lo, hi = prompt_logprob_span(seq, start, n)
        return n + self.attention_per_position * attended + self.logits_row * max(0, hi - lo)

    def fit(self, seq: Sequence, start: int, most: int, allowance: float) -> int:
        """The most tokens (<= `most`) of `seq` from `start` whose chunk costs at most `allowance`."""
        allowance += SLACK  # shares are float splits of an integer cap: 7.999999 tokens is 8
        if self.plain:
            return max(0, min(most, int(allowance)))
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.chunk(seq, start, mid) <= allowance:
                lo = mid
            else:
                hi = mid - 1
        return lo


PLAIN = StepCost()
SLACK = 1e-6


def _attended(lo: int, hi: int, window: int | None) -> float:
    """sum of min(p, window) over p = lo..hi: the positions queries lo-1..hi-1 attend."""
    top = hi if window is None else min(hi, window)
    below = (lo + top) * (top - lo + 1) / 2 if top >= lo else 0.0
    return below + (0 if window is None else window * max(0, hi - max(lo - 1, window)))


def prompt_logprob_span(seq: Sequence, start: int, n: int) -> tuple[int, int]:
    """Prompt positions lo..hi among start..start+n whose logits give prompt logprobs still owed (each
    position's logits give the next token's); lo >= hi when none."""
    owed = seq.group.prompt_logprobs
    if owed is None:
        return 0, 0
    return max(start, len(owed) - 1), min(start + n, seq.num_prompt_tokens - 1)
