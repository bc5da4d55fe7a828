"""The engine-core wire messages: msgspec Structs, msgpack over ZMQ (never pickle).

Front end -> core (FrontMessage, decoded by the core's input thread after ZMQ bounded its size):
Hello (a front end's output address), Submit (one EngineRequest), Abort, Command (adapter calls and
queries, answered by a Reply). Core -> front end (CoreMessage): Ready (EngineInfo, once), Fatal,
Accepted (a Submit's verdict, before any of its outputs), Outputs (one step's deltas for that front
end), Reply, and Stats (the snapshot, pushed every STATS_INTERVAL_S: the front end's heartbeat too).
The existing frozen dataclasses (SamplingParams, EngineInfo, EngineSnapshot) travel as msgspec encodes
dataclasses: their fields, typed and validated again (__post_init__) on decoding.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from server.engine.protocol.info import EngineInfo
from server.engine.protocol.snapshot import EngineSnapshot
from server.engine.sequence import SamplingParams

STATS_INTERVAL_S = 0.25


class Hello(msgspec.Struct, tag="hello"):
    output_address: str  # where the core's output thread connects its PUSH socket for this front end


class Submit(msgspec.Struct, tag="submit"):
    request_id: str
    prompt_ids: bytes  # int32 (server.engine.core.arrays)
    params: SamplingParams
    version_id: str | None
    tenant: str | None
    priority: int
    tenant_weight: float | None
    cache_salt: str | None
    grammar_json: str | None  # the front end's compiled grammar, xgrammar's serialised form


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class AbortChoice(msgspec.Struct, tag="abort_choice"):
    """A stop string ended one choice in the front end (server.engine.choice_abort)."""

    request_id: str
    index: int
    kept: int  # its output tokens the client was given


class Command(msgspec.Struct, tag="command"):
    call_id: int  # 0: no reply wanted
    op: str  # server.engine.core.commands.OPS
    version_id: str | None = None
    tenant: str | None = None  # whose command it is, where the op is bounded per tenant (pin_adapter)
    seconds: float | None = None  # nap's


FrontMessage = Union[Hello, Submit, Abort, AbortChoice, Command]


class Logprobs(msgspec.Struct, array_like=True):
    """TokenLogprobs entries packed: each entry's token and logprob, its top count, and the tops flat."""

    token_ids: bytes
    values: bytes
    top_counts: bytes
    top_ids: bytes
    top_values: bytes


class OutputDelta(msgspec.Struct, array_like=True):
    """What one choice gained since the last delta sent for it (outputs are cumulative in the engine)."""

    request_id: str
    index: int
    token_ids: bytes  # int32, the new tokens (no text: the front end detokenizes)
    finished: bool
    finish_reason: str | None
    error: str | None
    error_is_client: bool  # the error is the request's own doing (RequestOutput.error_is_client): a 400
    num_cached_tokens: int
    logprobs: Logprobs | None  # the new tokens' entries; None unless asked for
    prompt_logprobs: Logprobs | None  # once per request (entries after the first, which is None)


class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo
    snapshot: EngineSnapshot
    pid: int


class Fatal(msgspec.Struct, tag="fatal"):
    error: str


class Accepted(msgspec.Struct, tag="accepted"):
    request_id: str
    error: str | None = None
    invalid: bool = False  # the error is the request's (RequestError): a 400, not the engine's fault


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[OutputDelta]
    # The snapshot as of the step that made them: a front end woken by an output finds stats at least
    # as new (EngineClient.stats' contract, as in the in-process mode).
    snapshot: EngineSnapshot


class Reply(msgspec.Struct, tag="reply"):
    call_id: int
    value: Any = None
    error: str | None = None
    snapshot: EngineSnapshot | None = None  # as of the command (set by the output thread), like Outputs'


class Stats(msgspec.Struct, tag="stats"):
    snapshot: EngineSnapshot
    load_seconds: list[float]  # adapter loads (Redis -> host) since the last Stats
    refused_messages: int  # front-end messages refused (malformed) since the core started
    device_load_seconds: list[float] = []  # adapter copies (host -> a device slot) since the last Stats


CoreMessage = Union[Ready, Fatal, Accepted, Outputs, Reply, Stats]
