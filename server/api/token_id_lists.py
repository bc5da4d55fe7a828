"""Token-id arrays validated at C speed (issue 35): a body's prompt of 64 x 2,046 ids took pydantic
~17 ms to validate, one C call holding the GIL, while the event loop relaying every stream waited.

A model names its token-id fields in `TOKEN_ID_FIELDS` (field name -> TokenIdField). Where such
a field of the parsed body is a list of plain ints, or a list of non-empty lists of plain ints,
every id within TokenId's bounds and the list within its length (msgspec checks it, ~1 ms for
that prompt), pydantic gets a one-id stand-in of the same shape to validate and the model gets the body's own
lists back afterwards: the same model pydantic would build. Anything else (a bool, a float, an id
out of range, an empty list, a string) goes through pydantic whole, so every refusal and its
message stay pydantic's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from pydantic import BaseModel

TOKEN_ID_MIN, TOKEN_ID_MAX = 0, (1 << 31) - 1
# msgspec checks these at C speed, strictly: a bool or a float is no token id, as for pydantic's TokenId.
_ID = Annotated[int, msgspec.Meta(ge=TOKEN_ID_MIN, le=TOKEN_ID_MAX)]
_IDS = Annotated[list[_ID], msgspec.Meta(min_length=1)]
_BATCH = Annotated[list[_IDS], msgspec.Meta(min_length=1)]


@dataclass(frozen=True)
class TokenIdField:
    """A model field that may hold token ids: a list (of at most `max_items` where given), and where
    `batch`, also a list of such lists (a completions prompt batch)."""

    max_items: int | None = None
    batch: bool = False


def _stand_in(value: Any, spec: TokenIdField) -> list | None:
    """A one-id value of `value`'s shape, or None where pydantic must see the value itself."""
    if type(value) is not list or not value or (spec.max_items is not None and len(value) > spec.max_items):
        return None
    batch = type(value[0]) is list
    if batch and not spec.batch:
        return None
    try:
        msgspec.convert(value, _BATCH if batch else _IDS, strict=True)
    except msgspec.ValidationError:
        return None
    return [[TOKEN_ID_MIN]] if batch else [TOKEN_ID_MIN]


def stand_ins(cls: type[BaseModel], body: dict) -> tuple[dict, dict[str, list]]:
    """`body` with its plain token-id lists replaced by stand-ins, and the lists taken out."""
    fields: dict[str, TokenIdField] = getattr(cls, "TOKEN_ID_FIELDS", {})
    replaced: dict[str, list] = {}
    taken: dict[str, list] = {}
    for name, spec in fields.items():
        stand_in = _stand_in(body.get(name), spec)
        if stand_in is not None:
            replaced[name], taken[name] = stand_in, body[name]
    return ({**body, **replaced} if replaced else body), taken


def put_back(model: BaseModel, taken: dict[str, list]) -> None:
    """The body's own lists in place of their stand-ins (pydantic would have built equal lists)."""
    for name, value in taken.items():
        object.__setattr__(model, name, value)
