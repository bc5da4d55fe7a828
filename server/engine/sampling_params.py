"""Per-request generation settings, with vLLM's names and semantics."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from server.engine.structured_outputs import StructuredOutputsParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): the distribution is one-hot to within
# float32 precision there anyway, and dividing logits by a tiny or denormal value overflows to inf.
SAMPLING_EPS = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature < SAMPLING_EPS (1e-5), so 0 and any tiny or denormal value alike.

    Logits are modified in vLLM's order: logit_bias, then min_tokens masking of EOS and
    stop_token_ids, then repetition / presence / frequency penalties; greedy takes the argmax
    there, sampling goes on with temperature, top_k, top_p (which always keeps the top token),
    min_p. `logprobs` and `prompt_logprobs` report the model's own distribution, before any
    of these modifications (what OpenAI reports): under a structured-output constraint too,
    as vLLM reports by default (the raw distribution, not the one the grammar masked).

    `structured_outputs` constrains every choice to a JSON schema, any JSON object, a regex,
    one of a list of strings or an EBNF grammar (server.engine.grammar); a choice whose
    grammar is complete ends with finish_reason "stop", and the grammar's mask is applied
    before logit_bias, so no bias can unmask a token.

    `seed` makes choice i's samples depend only on (seed, i, the token's index in the
    output), never on its batch neighbours or on preemption. `n` choices share one prefill.
    `max_tokens` may be 0 only with `prompt_logprobs` (score the prompt, generate nothing).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0
    # Token id -> bias added to its logit. A dict for vLLM/OpenAI compatibility: hashing a
    # SamplingParams that has one raises TypeError, as hashing any dict does.
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top alternatives per generated token (0: the token's own only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    structured_outputs: StructuredOutputsParams | None = None
    # False: this request never runs drafts (speculative decoding, when the engine has it); its output
    # is the same either way, only its speed differs.
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, 0)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be >= 1 (0 only with prompt_logprobs, to score the prompt)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        _check_int("top_k", self.top_k, 0)
        if self.seed is not None:
            _int("seed", self.seed)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        _check_int("n", self.n, 1, MAX_N)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -MAX_PENALTY, MAX_PENALTY)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError("repetition_penalty must be a finite number > 0")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        if not isinstance(self.speculative, bool):
            raise ValueError("speculative must be true or false")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    # Cached (read per row per step): cached_property writes the instance dict directly, which a
    # frozen dataclass allows.
    @cached_property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @cached_property
    def has_row_state(self) -> bool:
        """Sampling reads more of the sequence than its params: its tokens (penalties), stop ids or
        grammar matcher."""
        return self.has_penalties or self.min_tokens > 0 or self.structured_outputs is not None


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer")
    return value


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    _int(name, value)
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high}]" if high is not None else f"{name} must be >= {low}")


def _check_float(name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}]")


def _bias(bias) -> dict[int, float]:
    """A private copy (the caller's dict may change later) with int keys and float values."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be a mapping of token id to bias")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if _int("logit_bias", token) < 0:
            raise ValueError("logit_bias token ids must be >= 0")
        _check_float("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        out[token] = float(value)
    return out
