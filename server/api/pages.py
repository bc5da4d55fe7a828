"""The HTML pages and the files they load: the landing page at /, the admin console at /admin/ui (it
asks for the admin token and calls the admin API with it) and the API reference at /docs (it renders
/openapi.json).

Each page is markup only; its script and style are files under web/, served at /assets/<name> from a
fixed list, so the pages run under a CSP without 'unsafe-inline' (server.api.response_headers). No
page loads anything from another origin: servers and their users may be air-gapped.
"""
from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from server.api.errors import not_found

_WEB = Path(__file__).parent / "web"
_ASSET_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                ".svg": "image/svg+xml"}
_ASSETS = frozenset({"console.js", "console.css", "docs.js", "docs.css", "landing.css", "favicon.svg"})
# The console's page and files are never cached: a new version is picked up at the next load, and
# nothing of an admin session is left in a shared cache.
_NO_STORE = {"Cache-Control": "no-store"}


def _page(name: str) -> Response:
    return HTMLResponse((_WEB / name).read_text(encoding="utf-8"), headers=_NO_STORE)


async def landing(request: Request) -> Response:
    return _page("landing.html")


async def console(request: Request) -> Response:
    return _page("console.html")


async def docs(request: Request) -> Response:
    return _page("docs.html")


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in _ASSETS:
        raise not_found("that asset")
    return Response((_WEB / name).read_bytes(), media_type=_ASSET_TYPES[Path(name).suffix], headers=_NO_STORE)


async def favicon(request: Request) -> Response:
    # Browsers ask for /favicon.ico on their own; an SVG answers it (every current browser takes one),
    # and as an image it runs no script (its CSP is the API's: nothing may load or run).
    return Response((_WEB / "favicon.svg").read_bytes(), media_type=_ASSET_TYPES[".svg"],
                    headers={"Cache-Control": "max-age=86400"})


ROUTES = [
    Route("/", landing, methods=["GET"]),
    Route("/admin/ui", console, methods=["GET"]),
    Route("/docs", docs, methods=["GET"]),
    Route("/assets/{name}", asset, methods=["GET"]),
    Route("/favicon.ico", favicon, methods=["GET"]),
]
