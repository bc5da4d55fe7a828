"""Counting a refused request against its tenant (tenants.RefusalLog), by reason: what an operator
reads to see who is being turned away (429s) or keeps sending what fails (4xx), and who meets errors.

Only requests whose API key was accepted are counted (server.api.auth puts the tenant on the
request): a bad key names no tenant, and the auth throttle counts those. Counting is best effort: a
refusal is answered whether or not Redis takes its count.
"""
from __future__ import annotations

import logging

import redis
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from tenants import REFUSAL_REASONS

log = logging.getLogger(__name__)

_BY_STATUS = {400: "invalid_request", 405: "invalid_request", 422: "invalid_request", 403: "forbidden",
              404: "not_found", 409: "conflict", 413: "too_large", 503: "unavailable"}


def refusal_reason(status: int, code: str | None) -> str | None:
    """The RefusalLog reason of an error answer; None for an answer that is not a refusal."""
    if code == "store_unavailable":
        return None  # Redis is down: counting would wait out its timeout and fail too
    if status == 429:
        # A rate limit names itself in the error code (tenants.Limiter).
        return code if code in REFUSAL_REASONS else None
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return "server_error" if status >= 500 else None


async def count_refusal(request: Request, status: int, code: str | None) -> None:
    tenant = getattr(request.state, "tenant", None)
    reason = refusal_reason(status, code)
    if tenant is None or reason is None:
        return
    try:
        await run_in_threadpool(request.app.state.lp.refusals.record, tenant, reason)
    except redis.RedisError as e:
        log.warning("counting a %s refusal of tenant %r failed (%r)", reason, tenant.name, e)
