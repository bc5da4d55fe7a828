"""Bearer authentication: tenant API keys for /v1, the admin token for /admin, the metrics token
for /metrics; and the throttle on failed attempts at each.

Failed tenant-key attempts are throttled per client address and per key id (tenants.limits
says why the two differ: an address over the limit is refused before its key is checked, a key
id under attack still admits its right secret). The client address is the connection's peer, or
what a trusted proxy put in X-Forwarded-For (uvicorn's --forwarded-allow-ips, FORWARDED_ALLOW_IPS).

AdminAuthThrottle: failed admin-token and metrics-token attempts throttled per client address,
with the same Redis counters and limit as tenant keys (tenants.limits), so one address that
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

import base64
import binascii
import hmac
import logging

import redis
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError
from server.api.state import ServerState
from tenants import Tenant
from tenants.store import parse_key

log = logging.getLogger(__name__)

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def basic_password(request: Request) -> str | None:
    """The password of HTTP Basic credentials (the user name is not read): how scrapers that cannot send a
    bearer token (aiperf's, through a netrc file or a URL's user:password) present the metrics token."""
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or len(encoded) > 1024:
        return None
    try:
        _, sep, password = base64.b64decode(encoded.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return password if sep and password else None


def state_of(request: Request) -> ServerState:
    return request.app.state.lp


def _throttled(wait: int, why: str) -> APIError:
    return APIError(429, f"too many failed authentications {why}; retry after {wait} s", "auth_throttled",
                    {"Retry-After": str(wait)})


def _authenticate(state: ServerState, token: str, address: str | None) -> Tenant:
    """Blocking: the throttle check, the key check, and the count of a failure."""
    wait = state.auth_throttle.blocked(address)
    if wait is not None:
        state.metrics.auth_failures.labels("throttled").inc()
        raise _throttled(wait, "from this address")
    tenant = state.tenants.authenticate(token)
    if tenant is not None:
        return tenant
    parsed = parse_key(token)
    wait = state.auth_throttle.failed(address, None if parsed is None else parsed[0])
    if wait is not None:
        state.metrics.auth_failures.labels("throttled").inc()
        raise _throttled(wait, "for this key or from this address")
    state.metrics.auth_failures.labels("invalid").inc()
    raise APIError(401, "invalid API key", "invalid_api_key", _CHALLENGE)


async def require_tenant(request: Request) -> Tenant:
    token = bearer_token(request)
    if token is None:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                       "missing_api_key", _CHALLENGE)
    address = request.client.host if request.client is not None else None
    tenant = await run_in_threadpool(_authenticate, state_of(request), token, address)
    # Who a refusal of this request is counted against (server.api.refusal_count).
    request.state.tenant = tenant
    return tenant


def _matches(token: str, expected: str | None) -> bool:
    # Constant time in the token's content; bytes so that any header text compares safely.
    return expected is not None and hmac.compare_digest(token.encode("utf-8", "surrogateescape"),
                                                        expected.encode("utf-8"))


def require_admin(request: Request) -> None:
    token = bearer_token(request)
    if token is None:
        raise APIError(401, "missing admin token: send 'Authorization: Bearer <admin token>'",
                       "missing_api_key", _CHALLENGE)
    if not _matches(token, state_of(request).config.admin_token):
        if parse_key(token) is not None:
            raise APIError(403, "tenant API keys cannot use the admin API", "forbidden")
        raise APIError(401, "invalid admin token", "invalid_api_key", _CHALLENGE)


def require_metrics_reader(request: Request) -> None:
    """/metrics names tenants: the admin token or the metrics token, unless --metrics-public."""
    config = state_of(request).config
    if config.metrics_public:
        return
    token = bearer_token(request) or basic_password(request)
    if token is None:
        raise APIError(401, "missing token: /metrics needs 'Authorization: Bearer <admin or metrics token>' (or "
                            "HTTP Basic credentials with that token as the password)",
                       "missing_api_key", _CHALLENGE)
    admin_ok = _matches(token, config.admin_token)
    metrics_ok = _matches(token, config.metrics_token)
    if not (admin_ok or metrics_ok):
        if parse_key(token) is not None:
            raise APIError(403, "tenant API keys cannot read /metrics", "forbidden")
        raise APIError(401, "invalid token for /metrics", "invalid_api_key", _CHALLENGE)


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
