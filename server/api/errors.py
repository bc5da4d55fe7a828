"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}, and the mapping of
every domain exception to its status, so bad input never becomes a 500."""
from __future__ import annotations

import json
import logging

import redis
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match

from adapters.format import AdapterFormatError
from adapters.registry import AdapterExists, AdapterNotFound, AdapterQuotaExceeded
from adapters.sources import SourceError
from server.api.refusal_count import count_refusal
from server.engine.protocol import EngineDeadError, RequestError
from tenants import (QuotaError, QuotaExceeded, RequestTooLarge, TenantExists, TenantNameError,
                     TenantNotFound)

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "request_too_large", 429: "rate_limit_error",
          500: "internal_error", 502: "upstream_error", 503: "service_unavailable", 504: "upstream_timeout"}


# Redis restarts (or fails over) in seconds; clients should come back about then.
ENGINE_RETRY_AFTER_SECONDS = 1
REDIS_RETRY_AFTER_SECONDS = 2


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault, when one is (OpenAI's error.param)
        assert status in _TYPES, status
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES[self.status], "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        # ASCII-escaped: a message may quote client input, and no input can make the error unsendable.
        return Response(json.dumps(self.body(), ensure_ascii=True), status_code=self.status,
                        headers=self.headers, media_type="application/json")


def not_found(what: str) -> APIError:
    return APIError(404, f"{what} does not exist", "not_found")


def to_api_error(exc: BaseException) -> APIError:
    """The APIError for a known exception; a 500 only for the unknown."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QuotaExceeded):
        return APIError(429, exc.message, exc.limit_name,
                        {"Retry-After": str(exc.retry_after_seconds)})
    if isinstance(exc, AdapterQuotaExceeded):
        # Not transient: waiting never helps, only deleting an adapter or a higher quota does.
        return APIError(403, f"{exc}; delete one or ask the operator for a higher max_adapters",
                        exc.limit_name)
    if isinstance(exc, RequestTooLarge):
        return APIError(400, exc.message, exc.limit_name, param="max_tokens")
    if isinstance(exc, QuotaError):
        return APIError(400, str(exc), "invalid_field", param=f"quota.{exc.field}"[:128])
    if isinstance(exc, TenantNameError):
        return APIError(400, str(exc), "invalid_field", param="name")
    if isinstance(exc, TenantExists):
        return APIError(409, str(exc), "tenant_exists")
    if isinstance(exc, TenantNotFound):
        return APIError(404, str(exc), "not_found")
    if isinstance(exc, AdapterExists):
        return APIError(409, f"{exc}; send replace=true to replace it", "adapter_exists")
    if isinstance(exc, AdapterNotFound):
        return APIError(404, "the adapter does not exist", "not_found")
    if isinstance(exc, SourceError):
        return APIError(exc.status, exc.message, exc.code)
    if isinstance(exc, AdapterFormatError):
        return APIError(400, str(exc), "invalid_adapter", param=exc.param)
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), "invalid_request")
    if isinstance(exc, EngineDeadError):
        # Retry-After: a replica behind a balancer is being replaced, or (--engine-process separate) the
        # server is about to exit for its orchestrator to restart it.
        return APIError(503, str(exc), "engine_unavailable", {"Retry-After": str(ENGINE_RETRY_AFTER_SECONDS)})
    if isinstance(exc, redis.RedisError):
        log.warning("Redis unavailable: %r", exc)
        return APIError(503, "the tenant and adapter store (Redis) is unavailable; retry shortly",
                        "store_unavailable", {"Retry-After": str(REDIS_RETRY_AFTER_SECONDS)})
    if isinstance(exc, HTTPException):
        status = exc.status_code if exc.status_code in _TYPES else 400
        return APIError(status, str(exc.detail), None, dict(exc.headers or {}))
    log.error("unhandled error", exc_info=exc)
    return APIError(500, "internal server error", "internal_error")


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path: a path's methods may be split over several routes,
    and Starlette's own 405 names only those of the first one that matched."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


async def _handle(request: Request, exc: Exception) -> Response:
    error = to_api_error(exc)
    if error.status == 405:
        error.headers["Allow"] = _allowed_methods(request)
    await count_refusal(request, error.status, error.code)
    return error.response()


EXCEPTION_HANDLERS = {Exception: _handle, HTTPException: _handle, APIError: _handle,
                      QuotaExceeded: _handle, AdapterQuotaExceeded: _handle,
                      RequestTooLarge: _handle, QuotaError: _handle, TenantNameError: _handle,
                      TenantExists: _handle, TenantNotFound: _handle, AdapterExists: _handle,
                      AdapterNotFound: _handle, AdapterFormatError: _handle, RequestError: _handle,
                      EngineDeadError: _handle, redis.RedisError: _handle, SourceError: _handle}
