"""EngineRequest: one accepted request, as the front end hands it to the engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.engine.sequence import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """Everything the engine needs to run one request's n choices, built once by the route.

    A message: plain fields (ids, strings, numbers, a frozen SamplingParams) so that a later
    msgspec/ZMQ transport to an engine-core process can carry it unchanged. The one exception is
    `grammar`, the constraint compiled already (off the step loop, under a deadline); over a
    transport it would travel serialized (xgrammar's JSON form) or be compiled by the core.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    version_id: str | None = None  # the adapter version; None: the base model
    tenant: str | None = None  # the tenant's id: fair share and prefix-cache isolation
    priority: int = 0  # lower first, within a tenant
    tenant_weight: float | None = None  # the tenant's fair-share weight (updates the scheduler's copy)
    cache_salt: str | None = None  # partitions the prefix cache within the tenant
    grammar: Any = None  # params.structured_outputs compiled (server.engine.grammar); None: compiled by the engine
