"""Pydantic validation errors as OpenAI-shaped API errors.

The split the API has always made: a body of the wrong shape (a missing field,
a string where a number belongs) is 422; a well-formed value out of its range,
or a known field we cannot honour, is 400 and the message names the field.
"""
from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError

from server.api.errors import APIError
from server.api.openai_requests import Unsupported

M = TypeVar("M", bound=BaseModel)

# pydantic error types that mean "well-typed but out of range" (400); everything else is a shape error (422),
# an empty list where items are required included.
_RANGE_ERRORS = frozenset((
    "greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of", "finite_number",
    "too_long", "string_too_short", "string_too_long", "value_error", "literal_error",
    "enum", "int_from_float",
))


def _location(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "constrained-", "list[", "str", "int", "float",
                                       "dict[", "bool", "nullable")):
            out += ("." if out else "") + str(part)
    return out or "body"


def _error(e: ValidationError, range_status: int) -> APIError:
    errors = e.errors(include_url=False, include_input=False)
    # A union reports one error per member: a value of the right type for some member that broke
    # that member's constraints is out of range, not misshapen.
    ranged = [err for err in errors if err["type"] in _RANGE_ERRORS]
    if ranged and not any(err["type"] == "missing" for err in errors):
        first = ranged[0]
        where = _location(first["loc"])
        return APIError(range_status, f"'{where}': {first['msg']}", "invalid_value", param=where)
    first = errors[0]
    where = _location(first["loc"])
    return APIError(422, f"'{where}': {first['msg']}", "invalid_field", param=where)


def parse_model(cls: type[M], body: dict, range_status: int = 400) -> M:
    """Validate `body` into `cls`, then refuse what it cannot honour (`refuse_unsupported`).

    `range_status`: the admin API has always answered 422 for any invalid quota value.
    """
    try:
        model = cls.model_validate(body)
    except ValidationError as e:
        raise _error(e, range_status) from None
    refuse = getattr(model, "refuse_unsupported", None)
    if refuse is not None:
        try:
            refuse()
        except Unsupported as e:
            raise APIError(400, str(e), "unsupported", param=e.field) from None
    return model
