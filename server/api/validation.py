"""Pydantic validation errors as OpenAI-shaped API errors: every one is a 400 whose `param`
names the field at fault (OpenAI's and vLLM's status), and whose message says what is wrong:
a missing field, a value of the wrong type, out of range, or a known field we cannot honour.
"""
from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.types import Scope

from server.api.body import BASE_VALUES, read_json_as
from server.api.errors import APIError
from server.api.openai_requests import Unsupported
from server.api.request_fields import note_ignored, screen_fields

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
    try:
        model = cls.model_validate(body)
    except ValidationError as e:
        raise _error(e) from None
    refuse = getattr(model, "refuse_unsupported", None)
    if refuse is not None:
        try:
            refuse()
        except Unsupported as e:
            raise APIError(400, str(e), "unsupported", param=e.field) from None
    return model


async def read_model(request: Request, cls: type[M], max_values: int = BASE_VALUES,
                     lenient_scope: Scope | None = None) -> M:
    """The body read, parsed and validated into `cls` (parse_model): a large one all on a worker thread."""
    return await read_json_as(request, lambda body: parse_model(cls, body, lenient_scope), max_values)
