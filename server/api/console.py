"""The admin console at /admin/ui (one self-contained page; it asks for the admin token and calls the
admin API with it), and a landing page at / that points to it, the API docs and /health."""
from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

_PAGE = Path(__file__).parent / "console.html"
_SECURITY_HEADERS = {
    # Everything the page needs is inline and same-origin; nothing may load from elsewhere.
    "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_LANDING = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>loraplex</title></head>
<body style="font: 15px system-ui, sans-serif; max-width: 640px; margin: 60px auto">
<h1>loraplex</h1><p>Multi-tenant LoRA serving with an OpenAI-compatible API under <code>/v1</code>.</p>
<ul><li><a href="/admin/ui">Admin console</a> (the admin token)</li>
<li><a href="/docs">API reference</a> (<a href="/openapi.json">openapi.json</a>)</li>
<li><a href="/health">Health</a> and <a href="/version">version</a></li></ul></body></html>"""


async def console(request: Request) -> Response:
    return HTMLResponse(_PAGE.read_text(encoding="utf-8"), headers=_SECURITY_HEADERS)


async def landing(request: Request) -> Response:
    return HTMLResponse(_LANDING, headers=_SECURITY_HEADERS)


ROUTES = [
    Route("/admin/ui", console, methods=["GET"]),
    Route("/", landing, methods=["GET"]),
]
