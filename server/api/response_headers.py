"""The headers every response carries, added by pure-ASGI wrappers around the whole app.

Pure ASGI on purpose: each edits only the `http.response.start` message and passes every body
message through as it comes, so SSE streams are never buffered (Starlette's BaseHTTPMiddleware
would put each response through a memory stream). Starlette keeps its ServerErrorMiddleware
outside all user middleware, so the one response without these headers is the 500 sent for an
exception that no specific handler maps (that is, a bug).

SecurityHeaders: the browser-facing hardening headers on every response.

Every response says `X-Content-Type-Options: nosniff` (a JSON body, or a tenant's
text echoed in one, is never run as script or rendered as HTML), may not be framed
(`frame-ancestors 'none'` and, for older browsers, `X-Frame-Options: DENY`) and
sends no referrer. The Content-Security-Policy depends on what the response is:

- an HTML page (the console, /docs, the landing page): scripts, styles and
  connections from this origin only, as files (server.api.pages serves them);
  no inline script, inline handler (`onerror=`), inline style, eval, plugin,
  frame or `<base>`; and Trusted Types required, so even the page's own code
  cannot hand a string to `innerHTML` or another DOM sink that parses markup.
- anything else (JSON, SSE, Prometheus text): nothing at all may load or run.

A route that sets its own policy keeps it.

ReplicaHeader: names the replica on every response (`x-loraplex-replica`), so an operator
behind a load balancer, and the cluster tests, can see which process answered; with
--api-server-count N > 1 also which front end of the replica (`x-loraplex-front-end`, 0..N-1).
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
            "form-action 'self'; base-uri 'none'; frame-ancestors 'none'; "
            "require-trusted-types-for 'script'; trusted-types 'none'")
API_CSP = "default-src 'none'; frame-ancestors 'none'"
_ALWAYS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
           (b"referrer-policy", b"no-referrer")]
_CSP = b"content-security-policy"


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_hardened(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                names = {name.lower() for name, _ in headers}
                extra = [h for h in _ALWAYS if h[0] not in names]
                if _CSP not in names:
                    html = any(name.lower() == b"content-type" and value.startswith(b"text/html")
                               for name, value in headers)
                    extra.append((_CSP, (PAGE_CSP if html else API_CSP).encode("latin-1")))
                message = {**message, "headers": headers + extra}
            await send(message)

        await self.app(scope, receive, send_hardened)


REPLICA_HEADER = "x-loraplex-replica"
FRONT_END_HEADER = "x-loraplex-front-end"


class ReplicaHeader:
    def __init__(self, app: ASGIApp, replica: str, front_end: int | None = None) -> None:
        self.app = app
        self._headers = [(REPLICA_HEADER.encode("latin-1"), replica.encode("latin-1"))]
        if front_end is not None:  # which of --api-server-count's processes answered
            self._headers.append((FRONT_END_HEADER.encode("latin-1"), str(front_end).encode("latin-1")))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *self._headers]}
            await send(message)

        await self.app(scope, receive, send_named)
