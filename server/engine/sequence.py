"""A request in the engine: its generation settings (SamplingParams, the public Python API's), and its
state as it moves through waiting -> running -> finished (SequenceGroup, Sequence, RequestOutput).

A request asking for n choices is a SequenceGroup of n Sequences. Only choice 0
is scheduled until its prompt is prefilled; then the others fork from it,
sharing its prompt's KV blocks, and each goes on as a sequence of its own.

Per-request generation settings (SamplingParams), with vLLM's names and semantics.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from server.engine.structured_outputs import StructuredOutputsParams
from server.engine.token_counts import TokenCounts


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

    @cached_property
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

    @cached_property
    def plain_greedy(self) -> bool:
        """Its token is the raw logits' argmax and nothing more: no modification, draw or logprobs."""
        return self.greedy and not (self.logit_bias or self.has_row_state or self.logprobs is not None)


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


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenLogprobs(NamedTuple):
    """A token's logprob under the model (with the request's adapter), before any sampling
    modification, and the `top` most likely tokens there: (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class RequestOutput:
    """One choice of a request, so far (cumulative; `finished` on the last one of that choice).

    Not frozen: one is made per running sequence per step, and frozen
    dataclasses cost several times more to construct. `logprobs` is aligned
    with `token_ids`, `prompt_logprobs` with `prompt_token_ids` (its first
    entry None; complete from a request's first output on, and one list shared
    by its choices and outputs: read it, don't change it); both are None
    unless asked for.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str  # "" from the engine; the front end's text (server.engine.output_text) fills it
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason is "error" (this request alone failed)
    # The error is the request's own doing (its constraint was too costly to enforce,
    # server.engine.mask_lane): a client error, not the server's.
    error_is_client: bool = False
    index: int = 0  # the choice, 0..n-1
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Prompt tokens served from the prefix cache at the request's first admission (OpenAI's
    # usage.prompt_tokens_details.cached_tokens): always < len(prompt_token_ids); 0 with the cache off.
    num_cached_tokens: int = 0
    # LLM.generate only, when n > 1: every choice in index order (this object is choice 0).
    choices: list[RequestOutput] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def outputs(self) -> list[RequestOutput]:
        """All choices, vLLM-style (`out.outputs[i].text`), for n == 1 as for n > 1."""
        return self.choices if self.choices is not None else [self]


class SequenceGroup:
    """The n choices of one request, and what they share: the prompt and its logprobs."""

    __slots__ = ("request_id", "seqs", "needs_fork", "prompt_logprobs", "min_tokens_stop_ids", "num_cached_tokens",
                 "adapter_from", "_distinct_prompt")

    def __init__(self, request_id: str, prompt_logprobs: bool, min_tokens_stop_ids: tuple[int, ...]) -> None:
        self.request_id = request_id
        self.seqs: list[Sequence] = []  # by choice index
        # Choices 1.. wait for choice 0's prompt, then fork from it (set by Sequence, cleared by the scheduler).
        self.needs_fork = False
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if prompt_logprobs else None
        self.min_tokens_stop_ids = min_tokens_stop_ids  # EOS (unless ignored) and stop ids, masked by min_tokens
        # Prompt tokens whose KV came from the prefix cache when choice 0 was first admitted (vLLM
        # counts that admission only); None until then. Forked choices share that prefill.
        self.num_cached_tokens: int | None = None
        # The first position the adapter applies to (server.engine.lora.slots): 0 but for an activated LoRA,
        # whose point the scheduler finds at admission.
        self.adapter_from = 0
        self._distinct_prompt: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return len(self.seqs)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def distinct_prompt_ids(self) -> torch.Tensor:
        """The prompt's distinct ids as a CPU tensor [D <= P], made once: the repetition penalty reads
        them every step, and only whether a token occurs matters to it."""
        if self._distinct_prompt is None:
            self._distinct_prompt = torch.unique(torch.tensor(self.seqs[0].prompt_token_ids, dtype=torch.long))
        return self._distinct_prompt


class Sequence:
    """Token ids, progress and KV blocks of one choice of a request."""

    __slots__ = (
        "request_id", "prompt_token_ids", "token_ids", "params", "version_id", "tenant", "priority", "arrival",
        "status", "num_computed_tokens", "block_table", "finish_reason", "error", "_num_prompt", "index", "group", "logprobs", "cache_salt", "block_hashes",
        "num_registered_blocks", "grammar", "_output_counts", "proposed", "group_tables",
        "plain_row",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        version_id: str | None,
        arrival: int,
        tenant: str | None = None,
        priority: int = 0,
        index: int = 0,
        group: SequenceGroup | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.params = params
        self.version_id = version_id
        self.tenant = tenant
        self.priority = priority
        self.arrival = arrival  # monotone admission counter: preemption victims are the newest
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V sit in the cache
        self.block_table: list[int] = []
        # The other KV layer groups' tables, where the model has several (server.engine.group_blocks).
        self.group_tables: list[list[int]] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._num_prompt = len(self.prompt_token_ids)
        self.index = index
        if group is None:
            group = SequenceGroup(request_id, params.prompt_logprobs is not None, ())
        self.group = group
        group.seqs.append(self)
        if index:
            group.needs_fork = True
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # Prefix cache (server.engine.block_manager): the hash chain of token_ids' leading full blocks,
        # as far as it was needed (it depends on the tokens alone, so it survives preemption), and how
        # many leading blocks of block_table have been offered to the cache.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        # xgrammar GrammarMatcher of a constrained choice (set by the engine), advanced with every
        # accepted token. It follows the output tokens, which preemption keeps, so it stays valid.
        self.grammar = None
        self._output_counts: TokenCounts | None = None  # made on the first penalised step
        # Medusa drafts for the tokens after its last one, from the step that chose it (or ()):
        # server.engine.medusa_heads.
        self.proposed: list[int] | tuple[()] = ()
        # Its sampling row when the row reads nothing of it but its params and choice (no row state, no
        # fork, no seed): built on its first such step and reused (server.engine.model_runner).
        self.plain_row = None

    def output_counts(self) -> dict[int, int]:
        """How often each token occurs in the output so far (for the penalties), kept up to date
        incrementally (server.engine.token_counts): read, do not modify."""
        if self._output_counts is None:
            self._output_counts = TokenCounts(self._num_prompt)
        return self._output_counts.caught_up(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self._num_prompt :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self._num_prompt

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the KV cache: the whole prompt at first, then 1 per decode step."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def output(self) -> RequestOutput:
        """This choice so far, its text empty: the front end detokenizes (server.engine.output_text)."""
        error, group = self.error, self.group
        # Positional, in RequestOutput's field order: one is made per running sequence per step, and
        # keyword arguments cost twice the construction.
        return RequestOutput(
            self.request_id,
            self.prompt_token_ids,
            self.token_ids[self._num_prompt :],
            "",
            self.status is SequenceStatus.FINISHED,
            self.finish_reason,
            error,
            error is not None and self.grammar is not None and self.grammar.failure is not None,
            self.index,
            None if self.logprobs is None else self.logprobs[:],
            group.prompt_logprobs,
            group.num_cached_tokens or 0,
        )
