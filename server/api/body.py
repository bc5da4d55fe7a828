"""Reading a request body an attacker controls, from bytes to a validated pydantic model: bounded
before it is parsed, its top-level fields screened (every one honoured or refused, never ignored),
and its validation errors turned into OpenAI-shaped 400s.

The body's size is capped while it streams in (Content-Length first, then a
running count), so an oversized body is refused before it is buffered. The
parse itself is bounded too: integer literals longer than any real field
(Python's int() is quadratic past a few thousand digits and refuses 4,300),
NaN/Infinity literals, nesting deeper than any OpenAI body, and lone UTF-16
surrogates (valid JSON escapes that no UTF-8 encoder accepts, so they would
fail later, wherever the string is encoded) are all a 400 that says which.

The size of the document is bounded before it is built, and before it is all
received: its values are counted as its bytes arrive (server.api.value_count), and a body
with more than its endpoint can use (a completions body's token ids are at most
`--max-batch-prompts` x `max_model_len`) is a 400 once the count passes that, the
rest of the body never read. A large body is parsed on a worker thread, never on
the event loop.

Which top-level fields of a request body are read: OpenAI refuses an unrecognised request
argument with a 400; so does loraplex, naming it in `param`. vLLM instead ignores unknown fields
(with a warning in its own log); an operator whose clients rely on that starts the server with
`--lenient-request-fields`: the OpenAI-compatible endpoints then drop unknown
fields and name them in the `X-Loraplex-Ignored-Fields` response header, so the
caller still learns what was not read.

Fields by which other servers select an adapter (vLLM's offline `lora_request`,
TGI's and LoRAX's `parameters.adapter_id`, SGLang's `lora_path`, ...) are refused
in either mode: ignoring one answers with the base model in the adapter's place,
a wrong answer that looks right. LoRAX's top-level `adapter_id` is read
(server.api.adapter_references).

Pydantic validation errors as OpenAI-shaped API errors: every one is a 400 whose `param`
names the field at fault (OpenAI's and vLLM's status), and whose message says what is wrong:
a missing field, a value of the wrong type, out of range, or a known field we cannot honour.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError
from server.api.openai_requests import Unsupported
from server.api.token_id_lists import put_back, stand_ins
from server.api.value_count import ValueCounter, check_value_count

# Far deeper than any OpenAI request (chat content parts sit at depth 4) and far
# below the C parser's recursion limit, so a hostile body never recurses far.
MAX_JSON_DEPTH = 32
# A 64-bit integer has at most 20 digits; anything longer is no field we know.
MAX_INT_DIGITS = 24
# Values besides token ids that a body may carry (messages and their fields, logit_bias, stop ids).
BASE_VALUES = 1 << 16
# Bodies up to this size are parsed on the event loop: a thread hop would cost more than the parse.
INLINE_PARSE_BYTES = 64 << 10
_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
_MISSING = object()
_fast_decode = msgspec.json.Decoder().decode
T = TypeVar("T")
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})  # JSON values with no string or nesting in them


def _too_large(cap: int) -> APIError:
    return APIError(413, f"request body larger than the limit of {cap} bytes (--max-request-bytes)",
                    "request_too_large")


async def read_capped(request: Request, cap: int, counter: ValueCounter | None = None) -> bytearray:
    """The whole body, refusing with 413 as soon as it is known to exceed `cap` bytes, and with
    `counter`'s 400 as soon as the bytes so far hold too many values: the rest is never received
    (server.api.unread_body closes the connection). Each chunk is copied into one buffer as it
    arrives (sized by Content-Length where sent), never joined at the end: joining 15 MB of chunks
    was one copy holding the GIL on the event loop."""
    length = request.headers.get("content-length")
    expected = 0
    if length is not None:
        if not length.isascii() or not length.isdigit() or len(length) > 19:
            raise APIError(400, "invalid Content-Length header", "invalid_request")
        expected = int(length)
        if expected > cap:
            raise _too_large(cap)
    body = bytearray(expected)
    received = 0
    async for chunk in request.stream():
        end = received + len(chunk)
        if end > cap:
            raise _too_large(cap)
        body[received:end] = chunk  # in place while within the expected length, else appended
        received = end
        if counter is not None:
            counter.feed(body, received)
    del body[received:]  # a body shorter than its Content-Length (the server refuses it first)
    return body


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise APIError(400, f"an integer in the body has more than {MAX_INT_DIGITS} digits",
                       "invalid_json")
    return int(text)


def _parse_constant(name: str) -> Any:
    raise APIError(400, f"{name} is not valid JSON (only finite numbers are accepted)", "invalid_json")


def _check_string(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the body contains an unpaired UTF-16 surrogate (\\ud800-\\udfff) "
                                "in a string", "invalid_json") from None


def _check_tree(doc: Any) -> None:
    """Depth and string checks without recursion (the tree may be deep)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_string(node)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
        if isinstance(node, dict):
            for key, value in node.items():
                _check_string(key)
                stack.append((value, depth + 1))
        elif not set(map(type, node)) <= _SCALAR_TYPES:
            stack.extend((value, depth + 1) for value in node)
        # else: a list of numbers (token ids) has nothing below it to check; map and set run at C speed,
        # where one Python step per value cost 70% of parsing a 64-prompt token batch


def _decoded(raw: bytes | bytearray) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", "invalid_json") from None


def _loads(raw: bytes | bytearray, long_digits: bool) -> Any:
    """The standard library's parse: slower, but its errors are the messages clients see."""
    try:
        return json.loads(_decoded(raw), parse_int=_parse_int if long_digits else None,
                          parse_constant=_parse_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", "invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels",
                       "invalid_json") from None


def parse_json(raw: bytes | bytearray, max_values: int = BASE_VALUES, counter: ValueCounter | None = None) -> Any:
    """Parse a bounded JSON document; every malformed input is a 400 naming the problem.

    msgspec parses first (64 prompts of 2,046 ids: several times faster than json.loads, and it
    holds the GIL that much less); it accepts no document json.loads refuses and builds the same
    values from the ones both accept (big ints included; NaN, Infinity, lone surrogates and bad
    UTF-8 it refuses). Anything it refuses is parsed again by json.loads, whose error the 400 names.
    `counter`: the body's values already counted as it arrived (read_capped)."""
    if counter is None:
        counter = ValueCounter(max_values)
        counter.feed(raw, len(raw))
    if not counter.complete:
        check_value_count(_decoded(raw), max_values)
    # The per-literal digit check only where a long digit run exists (json.loads's hook does it).
    long_digits = b"0" * (MAX_INT_DIGITS + 1) in raw.translate(_DIGITS_AS_ZERO)
    doc = _MISSING
    if not long_digits:
        try:
            doc = _fast_decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            pass
    if doc is _MISSING:
        doc = _loads(raw, long_digits)
    _check_tree(doc)
    return doc


def parse_json_object(raw: bytes | bytearray, max_values: int = BASE_VALUES,
                      counter: ValueCounter | None = None) -> dict:
    body = parse_json(raw, max_values, counter)
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", "invalid_json")
    return body


async def read_json_object(request: Request, max_values: int = BASE_VALUES) -> dict:
    """Read (capped by the server's --max-request-bytes) and parse a JSON object body of at most
    `max_values` values; a large body is parsed on a worker thread."""
    return await read_json_as(request, lambda body: body, max_values)


async def read_json_as(request: Request, build: Callable[[dict], T], max_values: int = BASE_VALUES,
                       screen: Callable[[bytearray], None] | None = None) -> T:
    """read_json_object, then `build` (a model's validation) on the object where it was parsed: a large
    body's validation runs on the worker thread too, not on the event loop (64 prompts of 2,046 ids
    take ~10 ms to validate, holding the GIL, and every stream and /health waited for it). `screen`
    sees the raw body first, there too, and may refuse it before it is parsed."""
    counter = ValueCounter(max_values)
    raw = await read_capped(request, request.app.state.lp.config.max_request_bytes, counter)

    def parsed() -> T:
        if screen is not None:
            screen(raw)
        return build(parse_json_object(raw, max_values, counter))

    return parsed() if len(raw) <= INLINE_PARSE_BYTES else await run_in_threadpool(parsed)


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


M = TypeVar("M", bound=BaseModel)

# pydantic error types that mean "well-typed but out of range"; the rest say the value is misshapen.
_RANGE_ERRORS = frozenset((
    "greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of", "finite_number",
    "too_long", "too_short", "string_too_short", "string_too_long", "value_error", "literal_error",
    "enum", "int_from_float", "union_tag_invalid",
))


# How pydantic names a union's member in an error's location (not a field of the body).
_MEMBER_NAMES = frozenset(("str", "int", "float", "bool", "bytes", "none"))


def _location(loc: tuple) -> str:
    out, after_tagged_union = "", False
    for part in loc:
        text = str(part)
        member = after_tagged_union or text in _MEMBER_NAMES or "[" in text or text.startswith(
            ("function-", "constrained-", "lax-or-strict", "json-or-python"))
        # A tagged union's member is named by its tag (a discriminator value) right after it.
        after_tagged_union = text.startswith("tagged-union[")
        if isinstance(part, int):
            out += f"[{part}]"
        elif not member:
            out += ("." if out else "") + text
    return out or "body"


def _message(err: dict, where: str) -> str:
    if err["type"] == "too_short" and err.get("ctx", {}).get("actual_length") == 0:
        return f"'{where}' is empty; it needs at least {err['ctx']['min_length']} item(s)"
    if err["type"] == "extra_forbidden":
        return f"'{where}' is not a field loraplex reads (unknown fields are refused, never ignored)"
    if err["type"] == "missing":
        return f"'{where}' is required"
    return f"'{where}': {err['msg']}"


def _error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False, include_input=False)
    # A union reports one error per member: a value of the right type for some member that broke
    # that member's constraints is out of range, not misshapen.
    ranged = [err for err in errors if err["type"] in _RANGE_ERRORS]
    first = ranged[0] if ranged and not any(err["type"] == "missing" for err in errors) else errors[0]
    where = _location(first["loc"])
    code = "invalid_value" if first in ranged else "invalid_field"
    return APIError(400, _message(first, where), code, param=None if where == "body" else where)


def parse_model(cls: type[M], body: dict, lenient_scope: Scope | None = None) -> M:
    """Validate `body` into `cls`, then refuse what it cannot honour (`refuse_unsupported`).

    An unknown top-level field is a 400 naming it, unless `lenient_scope` is given (the server runs with
    --lenient-request-fields): it is then dropped and named in that request's response header."""
    body, ignored = screen_fields(cls, body, lenient_scope is not None)
    if lenient_scope is not None:
        note_ignored(lenient_scope, ignored)
    body, taken = stand_ins(cls, body)
    try:
        model = cls.model_validate(body)
    except ValidationError as e:
        raise _error(e) from None
    put_back(model, taken)
    refuse = getattr(model, "refuse_unsupported", None)
    if refuse is not None:
        try:
            refuse()
        except Unsupported as e:
            raise APIError(400, str(e), "unsupported", param=e.field) from None
    return model


async def read_model(request: Request, cls: type[M], max_values: int = BASE_VALUES,
                     lenient_scope: Scope | None = None, screen: Callable[[bytearray], None] | None = None) -> M:
    """The body read, parsed and validated into `cls` (parse_model): a large one all on a worker thread,
    after `screen` (read_json_as)."""
    return await read_json_as(request, lambda body: parse_model(cls, body, lenient_scope), max_values, screen)
