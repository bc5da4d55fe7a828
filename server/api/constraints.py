"""A request's structured-output constraint, from any of the ways clients ask for one:
OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs`
object, or its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
At most one way per request; the constraint is bounded (--max-schema-bytes) here,
before anything compiles it."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from starlette.concurrency import run_in_threadpool

from server.api.errors import APIError
from server.api.openai_requests import ChatCompletionRequest, CompletionRequest
from server.engine import StructuredOutputsParams
from server.engine.grammar import GrammarError
from server.engine.grammar_worker import GrammarCompilerBusy, GrammarCompileService, GrammarTimeout

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


class Constraint(NamedTuple):
    spec: StructuredOutputsParams
    param: str  # the request field it came from, named in any error about it


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}': {message}", "invalid_value", param=param)


def _from_response_format(fmt: dict) -> StructuredOutputsParams | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise _bad("response_format.type", f"must be one of text, json_object, json_schema; got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "must be an object with 'name' and 'schema'")
    unknown = sorted(set(spec) - set(_JSON_SCHEMA_KEYS))
    if unknown:
        raise _bad(f"response_format.json_schema.{unknown[0]}", "is not a json_schema field")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "must be a JSON schema object")
    # `strict` false is honoured as true: the output always follows the schema (as vLLM does).
    return StructuredOutputsParams(json=schema)


def _from_structured_outputs(obj) -> StructuredOutputsParams:
    if not isinstance(obj, dict):
        raise _bad("structured_outputs", "must be an object")
    unknown = sorted(set(obj) - set(_STRUCTURED_KEYS))
    if unknown:
        raise _bad(f"structured_outputs.{unknown[0]}", f"is not supported (supported: {', '.join(_STRUCTURED_KEYS)})")
    return StructuredOutputsParams(**{k: obj[k] for k in _STRUCTURED_KEYS if k in obj})


def constraint_of(req: CompletionRequest | ChatCompletionRequest, max_schema_bytes: int) -> Constraint | None:
    """The request's one constraint, or None; a 400 naming the field when it is malformed, when a
    request asks in two ways at once, or when it is larger than --max-schema-bytes."""
    found: list[Constraint] = []
    try:
        if req.response_format is not None:
            spec = _from_response_format(req.response_format)
            if spec is not None:
                found.append(Constraint(spec, "response_format"))
        if req.structured_outputs is not None:
            found.append(Constraint(_from_structured_outputs(req.structured_outputs), "structured_outputs"))
        for field, kind in _GUIDED.items():
            value = getattr(req, field)
            if value is not None:
                found.append(Constraint(StructuredOutputsParams(**{kind: value}), field))
    except (ValueError, TypeError) as e:
        param = next((f for f in ("structured_outputs", *_GUIDED) if getattr(req, f) is not None),
                     "response_format")
        raise _bad(param, str(e)) from None
    if not found:
        return None
    if len(found) > 1:
        # vLLM's wording for the same mistake.
        raise _bad(found[1].param, "You can only use one kind of structured outputs constraint but multiple "
                                   f"are specified: {[c.param for c in found]}")
    constraint = found[0]
    size = constraint.spec.schema_bytes
    if size > max_schema_bytes:
        raise _bad(constraint.param, f"the constraint is {size} bytes, over the limit of {max_schema_bytes} "
                                     "bytes (--max-schema-bytes)")
    return constraint


async def compile_constraint(compiler: GrammarCompileService, constraint: Constraint, owner: str = "",
                             spent: Callable[[float], None] | None = None):
    """The compiled grammar, compiled in a child process under --max-grammar-compile-ms (or from
    the cache); the caller holds the tenant's admission, so compiles count against its concurrency.
    `owner`, `spent`: GrammarCompileService.compile's."""
    try:
        return await run_in_threadpool(compiler.compile, constraint.spec, owner, spent)
    except GrammarTimeout as e:
        raise _bad(constraint.param, f"{e} (--max-grammar-compile-ms); simplify it") from None
    except GrammarCompilerBusy as e:
        raise APIError(503, f"{e}; retry shortly", "grammar_compiler_busy", {"Retry-After": "1"}) from None
    except GrammarError as e:
        raise _bad(constraint.param, str(e)) from None
