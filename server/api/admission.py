"""A request's admission in two steps: a gate before its body is read, then the charge of what it asks.

Before a byte of the body is read, the tenant is authenticated and takes one request of its rate
and one concurrency slot, charged 0 tokens: an over-quota tenant gets its 429 without its body
being read or parsed, and no tenant has more bodies in flight than its concurrency limit. A
generation hands the gate over once its body is parsed and its prompts are tokenized: each
prompt is then admitted with its real token estimate (all or none, see openai_routes). A request
refused at any point (a 4xx or a 429) is cancelled from the window: it counts in no per-minute
window and is never billed; except a constraint whose compile failed or hit its deadline, which
spent the server's CPU and stays counted as one request (server.api.compile_charge).
"""
from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import anyio
import redis
from starlette.concurrency import run_in_threadpool

from server.api.state import ServerState
from tenants import Admission, Tenant

log = logging.getLogger(__name__)


async def cancel_admission(state: ServerState, admission: Admission) -> None:
    """Undo an admission as if it had never been granted (shielded: a disconnect must not skip it): its
    lease is no longer beaten and nothing of it is recorded."""
    state.settlements.discard(admission)
    with anyio.CancelScope(shield=True):
        try:
            await run_in_threadpool(state.limiter.cancel, admission)
        except redis.RedisError as e:
            # The charge leaves the window and the lease expires on their own; nothing is billed.
            log.warning("cancelling the admission of %s failed (%r)", admission.request_id, e)


async def keep_admission(state: ServerState, admission: Admission) -> None:
    """End an admission that stays counted in the window (one request, 0 tokens): a request that
    succeeded as itself, or one refused after it cost the server work (a failed compile)."""
    state.settlements.discard(admission)
    with anyio.CancelScope(shield=True):
        try:
            await run_in_threadpool(state.limiter.release, admission, 0)
        except redis.RedisError as e:
            log.warning("releasing the admission of %s failed (%r); its lease will expire",
                        admission.request_id, e)


class Gate:
    """One request of the tenant's rate and one concurrency slot, held while the body is read."""

    def __init__(self, state: ServerState, admission: Admission) -> None:
        self._state = state
        self._admission = admission
        self._open = True

    async def hand_over(self) -> None:
        """Give the slot back before the request's own admissions take theirs (idempotent)."""
        if self._open:
            self._open = False
            await cancel_admission(self._state, self._admission)

    async def finish(self) -> None:
        """The request succeeded as itself (tokenize, detokenize): it stays counted in the window."""
        if self._open:
            self._open = False
            await keep_admission(self._state, self._admission)


@contextlib.asynccontextmanager
async def gated(state: ServerState, tenant: Tenant) -> AsyncIterator[Gate]:
    """Admit the tenant's request before its body is read; cancelled if the block raises
    (the request was refused), kept in the window if it ends normally."""
    admission = await run_in_threadpool(state.limiter.admit, tenant, "gate-" + uuid.uuid4().hex, 0)
    gate = Gate(state, admission)
    try:
        yield gate
    except BaseException:
        await gate.hand_over()
        raise
    await gate.finish()
