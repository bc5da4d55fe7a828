"""`strict: true` under tool_choice "auto": the structural tag that holds the calls the model
chooses to write to their functions' schemas, in the --tool-call-parser family's own format.

The output stays free text (the model may answer without a call); once it writes the family's
call trigger (`<tool_call>` for hermes, `{"name": "` for llama3_json), a grammar takes over
until the call closes: the name one of the offered functions, the arguments valid against the
function's parameters schema when it is strict, any JSON object when it is not. With
parallel_tool_calls false the output ends after the first call. This is what vLLM does for the
same request (a structural tag when a tool is strict, vllm-project/vllm#45600); xgrammar's
triggered tags compile it like any other constraint (--max-schema-bytes, --max-grammar-compile-ms).
"""
from __future__ import annotations

from server.api.tool_parsers import HERMES_CLOSE, HERMES_OPEN
from server.api.tool_requests import FunctionDefinition

# family -> (trigger, the call's opening with {name}, its closing), as the family's models write it
_FORMATS = {
    "hermes": (HERMES_OPEN, HERMES_OPEN + '\n{{"name": "{name}", "arguments": ', "}\n" + HERMES_CLOSE),
    "llama3_json": ('{"name": "', '{{"name": "{name}", "parameters": ', "}"),
}
_ANY_OBJECT = {"type": "object"}


def strict_call_tag(parser: str, functions: tuple[FunctionDefinition, ...], parallel: bool) -> dict:
    """xgrammar's structural tag (its JSON form) for auto calls in the `parser` family's format."""
    trigger, begin, end = _FORMATS[parser]
    tags = [{"type": "tag", "begin": begin.format(name=f.name),
             "content": {"type": "json_schema", "json_schema": f.parameters_schema if f.strict else _ANY_OBJECT},
             "end": end} for f in functions]
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                       "at_least_one": False, "stop_after_first": not parallel}}
