"""One request's state as it moves through waiting -> running -> finished."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from server.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestOutput:
    """A request's output so far (cumulative; `finished` on the last one).

    Not frozen: one is made per running request per step, and frozen
    dataclasses cost several times more to construct.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason is "error" (this request alone failed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Sequence:
    """Token ids, progress and KV blocks of a request (one sequence per request)."""

    __slots__ = (
        "request_id", "prompt_token_ids", "token_ids", "params", "adapter_id", "tenant", "priority", "arrival",
        "status", "num_computed_tokens", "block_table", "finish_reason", "error", "text", "text_cut",
        "detok_state", "stop", "_num_prompt",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter_id: str | None,
        arrival: int,
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.params = params
        self.adapter_id = adapter_id
        self.tenant = tenant
        self.priority = priority
        self.arrival = arrival  # monotone admission counter: preemption victims are the newest
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V sit in the cache
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.text = ""
        self.text_cut: int | None = None  # set when a stop string ended the text
        self.detok_state = None  # IncrementalDetokenizer's DetokState, set by the engine
        self.stop = None  # StopChecker, set by the engine
        self._num_prompt = len(self.prompt_token_ids)

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
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids,
            text=self.text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
        )
