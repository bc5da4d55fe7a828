"""A request's structured-output constraint, with vLLM's names (StructuredOutputsParams).

Exactly one of: `json` (a JSON schema, as a dict or its text), `json_object` (any JSON
object), `regex`, `choice` (one of these strings, verbatim), `grammar` (EBNF, in
xgrammar's GBNF dialect) or `structural_tag` (xgrammar's structural tag, as a dict: free text
with tagged parts such as tool calls held to a schema). Only a description:
server.engine.grammar compiles it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            # vLLM's message for the same mistake.
            raise ValueError("You can only use one kind of structured outputs constraint but multiple are "
                             f"specified: {given}" if given else "no structured outputs constraint is specified")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise ValueError("structural_tag must be an object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @cached_property
    def canonical(self) -> str:
        """The constraint as one string, the same for equal constraints whatever their key order
        or spacing (a JSON schema is re-serialised with sorted keys)."""
        kind = self.kind
        if kind in ("json", "structural_tag"):
            value = getattr(self, kind)
            value = json.loads(value) if isinstance(value, str) else value
            body = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            body = json.dumps(list(self.choice), ensure_ascii=False)
        elif kind == "json_object":
            body = ""
        else:
            body = getattr(self, kind)
        return f"{kind}:{body}"

    @cached_property
    def key(self) -> str:
        """sha256 of `canonical`: the compiled-grammar cache key (with the tokenizer's)."""
        return hashlib.sha256(self.canonical.encode()).hexdigest()

    @property
    def schema_bytes(self) -> int:
        """Size of the constraint as the client sent it, bounded by --max-schema-bytes."""
        return len(self.canonical.encode())
