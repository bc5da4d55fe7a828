"""What the engine core's threads hand each other on its two in-memory queues: typed, so a request's
arguments cross by name from the input socket to the step loop (no positional tuples), and each
consumer dispatches on the item's type.

inbox (the input socket and the fetching commands -> the step loop, server.engine.core.busy_loop);
outbox (everyone -> the output socket thread, server.engine.core.output_socket).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.engine.protocol.info import EngineInfo
from server.engine.protocol.residency import LoadTimes
from server.engine.protocol.snapshot import EngineSnapshot


# ---- inbox ----
@dataclass(frozen=True, slots=True)
class AddRequest:
    owner: bytes  # the front end that submitted it: its outputs and verdict go there
    request_id: str
    prompt_ids: list[int]
    params: Any  # SamplingParams
    version_id: str | None
    tenant: str | None
    priority: int
    tenant_weight: float | None
    cache_salt: str | None
    grammar: Any  # the bound compiled grammar, or None


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Call:
    """`fn(engine)` on the step loop's thread; its result (or error) goes back as Reply(call_id) unless
    call_id is 0 (fire and forget: a failure is logged)."""

    owner: bytes
    call_id: int
    fn: Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class Stop:
    pass


# ---- outbox ----
@dataclass(frozen=True, slots=True)
class PeerHello:
    owner: bytes
    address: str  # the front end's PULL socket


@dataclass(frozen=True, slots=True)
class CoreReady:
    info: EngineInfo
    snapshot: Callable[[], EngineSnapshot]
    take_load_times: Callable[[], LoadTimes]
    pid: int


@dataclass(frozen=True, slots=True)
class CoreFatal:
    error: str


@dataclass(frozen=True, slots=True)
class Track:
    """A request accepted for `owner`: its outputs are encoded as deltas and routed there."""

    request_id: str
    owner: bytes
    n: int


@dataclass(frozen=True, slots=True)
class StepOutputs:
    outputs: list  # the step's RequestOutputs


@dataclass(frozen=True, slots=True)
class Send:
    owner: bytes
    message: Any  # a server.engine.core.messages struct


@dataclass(frozen=True, slots=True)
class Flush:
    done: threading.Event  # set once everything queued before it was handled
