"""One request's state as it moves through waiting -> running -> finished.

A request asking for n choices is a SequenceGroup of n Sequences. Only choice 0
is scheduled until its prompt is prefilled; then the others fork from it,
sharing its prompt's KV blocks, and each goes on as a sequence of its own.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch


from server.engine.sampling_params import SamplingParams
from server.engine.token_counts import TokenCounts


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
    text: str
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
        # The first position the adapter applies to (server.engine.lora.alora): 0 but for an activated LoRA,
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
        "status", "num_computed_tokens", "block_table", "finish_reason", "error", "text", "text_cut",
        "detok_state", "stop", "_num_prompt", "index", "group", "logprobs", "cache_salt", "block_hashes",
        "num_registered_blocks", "grammar", "_output_counts", "proposed", "group_tables",
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
        self.text = ""
        self.text_cut: int | None = None  # set when a stop string ended the text
        self.detok_state = None  # IncrementalDetokenizer's DetokState, set by the engine
        self.stop = None  # StopChecker, set by the engine
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

    def output(self, text: str | None = None) -> RequestOutput:
        """This choice so far; `text` overrides the text (a streamed output holds back a possible stop string)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids,
            text=self.text if text is None else text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            error_is_client=self.error is not None and self.grammar is not None and self.grammar.failure is not None,
            index=self.index,
            logprobs=None if self.logprobs is None else self.logprobs[:],
            prompt_logprobs=self.group.prompt_logprobs,
            num_cached_tokens=self.group.num_cached_tokens or 0,
        )
