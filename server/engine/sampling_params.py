"""Per-request generation settings."""
from __future__ import annotations

import math
from dataclasses import dataclass

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): the distribution is one-hot to within
# float32 precision there anyway, and dividing logits by a tiny or denormal value overflows to inf.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature < SAMPLING_EPS (1e-5), so 0 and any tiny or denormal value alike;
    otherwise temperature, then top_k, then top_p (which always keeps at least the top token).

    `seed` makes a request's samples depend only on the seed and the token's
    index in the output, never on its batch neighbours or on preemption.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
