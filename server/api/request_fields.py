"""Which top-level fields of a request body are read: every one is honoured or refused, never ignored.

OpenAI refuses an unrecognised request argument with a 400; so does loraplex, naming
it in `param`. vLLM instead ignores unknown fields (with a warning in its own log);
an operator whose clients rely on that starts the server with
`--lenient-request-fields`: the OpenAI-compatible endpoints then drop unknown
fields and name them in the `X-Loraplex-Ignored-Fields` response header, so the
caller still learns what was not read.

Fields by which other servers select an adapter (vLLM's offline `lora_request`,
TGI's and LoRAX's `parameters.adapter_id`, SGLang's `lora_path`, ...) are refused
in either mode: ignoring one answers with the base model in the adapter's place,
a wrong answer that looks right. LoRAX's top-level `adapter_id` is read
(server.api.adapter_references).
"""
from __future__ import annotations

from pydantic import BaseModel
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError

IGNORED_FIELDS_HEADER = "X-Loraplex-Ignored-Fields"
_SCOPE_KEY = "loraplex.ignored_fields"
# Adapter selectors of other servers -> where they come from (the message says so).
FOREIGN_ADAPTER_SELECTORS = {
    "lora_request": "vLLM's offline API",
    "lora_name": "vLLM's adapter endpoints",
    "lora_int_id": "vLLM's adapter endpoints",
    "lora_path": "SGLang",
    "lora_id": "other servers",
    "lora": "other servers",
    "loras": "other servers",
    "adapter": "other servers",
    "adapters": "other servers",
    "adapter_name": "other servers",
    "adapter_ids": "LoRAX's merged adapters",
    "merged_adapters": "LoRAX",
    "parameters": "TGI's and LoRAX's /generate body",
}
MAX_NAMED = 8  # unknown fields named in one message or header; a hostile body may send thousands


def known_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(f.alias or name for name, f in model.model_fields.items())


def _quoted(names: list[str]) -> str:
    shown = ", ".join(repr(n[:64]) for n in names[:MAX_NAMED])
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


def _refuse_foreign_selector(body: dict, known: frozenset[str]) -> None:
    for name, origin in FOREIGN_ADAPTER_SELECTORS.items():
        if name in body and name not in known:
            param = name
            if name == "parameters" and isinstance(body[name], dict) and "adapter_id" in body[name]:
                param = "parameters.adapter_id"
            raise APIError(400, f"'{param}' selects an adapter as {origin} does; loraplex does not read it, and "
                                f"the base model answering in the adapter's place would be a wrong answer: "
                                f"name the adapter in 'model' (or send LoRAX's top-level 'adapter_id' with the "
                                f"base model)", "unsupported_adapter_selector", param=param)


def screen_fields(model: type[BaseModel], body: dict, lenient: bool) -> tuple[dict, list[str]]:
    """`body` with only the fields `model` reads, and the names of those dropped (lenient only).

    Strict (the default): any unknown field is a 400 naming it. Either way, another server's adapter
    selector is a 400."""
    known = known_fields(model)
    _refuse_foreign_selector(body, known)
    unknown = [name for name in body if name not in known]
    if not unknown:
        return body, []
    if not lenient:
        raise APIError(400, f"unrecognized request argument(s) supplied: {_quoted(unknown)}; loraplex refuses "
                            f"what it does not read (the README lists every parameter; an operator can start "
                            f"the server with --lenient-request-fields to ignore them instead)",
                       "unknown_field", param=unknown[0][:64])
    return {k: v for k, v in body.items() if k in known}, unknown


def lenient_scope(request: Request) -> Scope | None:
    """The request's scope where this server ignores unknown fields (parse_model records them there)."""
    return request.scope if request.app.state.lp.config.lenient_request_fields else None


def note_ignored(scope: Scope, names: list[str]) -> None:
    """Record fields a lenient server dropped, for IgnoredFieldsHeader to report."""
    if names:
        scope[_SCOPE_KEY] = names


def _header_safe(name: str) -> str:
    """A field name as printable ASCII without commas (it is client text, and headers carry no controls)."""
    return "".join(c if " " <= c <= "~" and c != "," else f"\\u{ord(c):04x}" for c in name[:64])


def header_value(names: list[str]) -> str:
    shown = ", ".join(_header_safe(n) for n in names[:MAX_NAMED])
    return shown + (f", (+{len(names) - MAX_NAMED} more)" if len(names) > MAX_NAMED else "")


class IgnoredFieldsHeader:
    """Adds X-Loraplex-Ignored-Fields to a response whose request had fields dropped (lenient mode).
    Pure ASGI (see server.api.response_headers): streamed responses pass through unbuffered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_noted(message: Message) -> None:
            names = scope.get(_SCOPE_KEY)
            if message["type"] == "http.response.start" and names:
                value = header_value(names).encode("ascii")
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (IGNORED_FIELDS_HEADER.lower().encode("ascii"), value)]}
            await send(message)

        await self.app(scope, receive, send_noted)
