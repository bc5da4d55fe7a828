"""Background upkeep of the shared store: tenant purges and retired adapter versions.

Both are also done inline when an admin deletes a tenant or a tenant writes
to the registry; the periodic pass makes them happen on an idle server and
finishes what a crashed process or a Redis outage left half done (a deleted
tenant whose adapters were not yet retired stays in the store's purge set).
"""
from __future__ import annotations

import asyncio
import logging

import redis
from starlette.concurrency import run_in_threadpool

from server.api.state import ServerState

log = logging.getLogger(__name__)


def purge_tenant(state: ServerState, tenant_id: str) -> int:
    """Retire every adapter of a deleted tenant (blocking); returns how many. Idempotent."""
    records = state.registry.delete_all(tenant_id)
    state.references.delete_all(tenant_id)
    for record in records:
        # This process drops them from its tiers now; others hear the registry's events.
        state.engine.remove_adapter_nowait(record.version)
    state.tenants.purged(tenant_id)
    return len(records)


def upkeep(state: ServerState) -> None:
    """One pass (blocking): finish pending tenant purges, free retired versions past their grace."""
    for tenant_id in state.tenants.pending_purges():
        purge_tenant(state, tenant_id)
    state.registry.collect_garbage()


async def run_upkeep(state: ServerState) -> None:
    """The periodic pass; Redis may be away for a while, so failures just wait for the next round."""
    interval = max(1.0, min(60.0, state.config.adapter_grace_seconds / 2))
    while True:
        await asyncio.sleep(interval)
        try:
            await run_in_threadpool(upkeep, state)
        except redis.RedisError:
            log.warning("store upkeep failed; retrying next round", exc_info=True)
