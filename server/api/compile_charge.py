"""A request's constraint compiled at the tenant's cost: a new constraint is refused (429) once the
tenant spent its --compile-seconds-per-minute, and the seconds a compile process spends on it are
charged whether it compiles, fails or is killed at its deadline. A cached constraint is free.
A failed compile's request also stays counted against requests_per_minute (server.api.generation):
its CPU was spent, so a flood of deadline-hitting schemas is neither free nor unbounded."""
from __future__ import annotations

import logging

import anyio
import redis
from starlette.concurrency import run_in_threadpool

from server.api.constraints import Constraint, compile_constraint
from server.api.state import ServerState
from tenants import Tenant

log = logging.getLogger(__name__)


async def charged_compile(state: ServerState, tenant: Tenant, constraint: Constraint):
    compiler = state.grammar_compiler
    cached = compiler.grammars.lookup(constraint.spec)
    if cached is not None:
        return cached
    limit = state.config.compile_seconds_per_minute
    if limit:
        await run_in_threadpool(state.compile_budget.check, tenant, limit)
    spent: list[float] = []
    try:
        return await compile_constraint(compiler, constraint, tenant.id, spent.append)
    finally:
        if spent:
            with anyio.CancelScope(shield=True):  # a client that leaves was charged all the same
                try:
                    await run_in_threadpool(state.compile_budget.charge, tenant.id, sum(spent))
                except redis.RedisError as e:
                    log.warning("charging tenant %r %.2f s of compiles failed (%r)", tenant.name, sum(spent), e)
