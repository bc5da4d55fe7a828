"""AdminAuthThrottle: failed admin-token and metrics-token attempts throttled per client address,
with the same Redis counters and limit as tenant keys (tenants.auth_throttle), so one address that
guesses at either is stopped by one budget, on every replica sharing the Redis.

Pure ASGI around the whole app, for every path that takes the admin or metrics token (`/admin/...`,
`/metrics`): every such route checks its token with `require_admin`/`require_metrics_reader`, so
guarding the paths here covers routes added later without touching them. Only requests that
present a bearer token are counted (a missing token is not a guess), and only their 401s (a tenant
key sent to the admin API gets a 403 and reveals nothing). /metrics also takes its token as an HTTP
Basic password, so Basic credentials count as a presented token too.

- Before the route: an address over the limit gets 429 with Retry-After before its token is
  checked, so past the limit even the right token proves nothing to a guesser there.
- After it: a 401 counts one failure for the address.

Redis errors fail open here: the token is still required, and an operator must be able to reach
`/admin` and `/metrics` while Redis is down to see why.
"""
from __future__ import annotations

import logging

import redis
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError

log = logging.getLogger(__name__)

def _guarded(path: str) -> bool:
    return path == "/metrics" or path.startswith("/admin/")


def _presents_credentials(scope: Scope) -> bool:
    """A bearer token, or HTTP Basic credentials (/metrics takes its token as a Basic password)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return value[:7].lower() == b"bearer " or value[:6].lower() == b"basic "
    return False


class AdminAuthThrottle:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _guarded(scope["path"]) or not _presents_credentials(scope):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state.lp
        client = scope.get("client")
        address = client[0] if client else None
        try:
            wait = await run_in_threadpool(state.auth_throttle.blocked, address)
        except redis.RedisError as exc:
            log.warning("admin auth throttle unavailable (%s); checking the token alone", exc)
            wait = None
        if wait is not None:
            state.metrics.auth_failures.labels("throttled").inc()
            error = APIError(429, f"too many failed authentications from this address; retry after {wait} s",
                             "auth_throttled", {"Retry-After": str(wait)})
            await error.response()(scope, receive, send)
            return

        status: list[int] = []

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, receive, watch)
        if status and status[0] == 401:
            state.metrics.auth_failures.labels("invalid").inc()
            try:
                await run_in_threadpool(state.auth_throttle.failed, address, None)
            except redis.RedisError as exc:
                log.warning("admin auth failure not counted (%s)", exc)
