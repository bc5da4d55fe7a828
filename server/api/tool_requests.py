"""The tool-calling parts of a chat request, as pydantic models (OpenAI's shapes): `tools`,
`tool_choice`, and the assistant's `tool_calls` fed back in `messages`. Bounded here, before
anything renders or compiles them: at most MAX_TOOLS functions, names OpenAI's way
(1-64 of A-Z a-z 0-9 _ -), descriptions and ids by length; a parameters schema's size is
checked against --max-schema-bytes by server.api.prompts."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError, WithJsonSchema,
                      field_validator)

MAX_TOOLS = 128  # OpenAI's limit
MAX_DESCRIPTION_CHARS = 8192
MAX_CALL_ID_CHARS = 256
MAX_TOOL_CALLS_PER_MESSAGE = 128
TOOL_CHOICE_MODES = ("none", "auto", "required")
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NAME_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}


def _check_name(name: str) -> str:
    # A validator, not a pattern: a pattern mismatch is a shape error (422); a bad name is a bad value (400).
    if not _NAME_RE.fullmatch(name):
        raise ValueError("a function name is 1-64 characters of A-Z a-z 0-9 _ -")
    return name


FunctionName = Annotated[str, AfterValidator(_check_name), WithJsonSchema(_NAME_SCHEMA)]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    description: Annotated[str, StringConstraints(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of type object; absent: no parameters")
    strict: bool | None = Field(None, description="arguments follow the schema always under tool_choice required "
                                                  "or a named function; under auto, true holds the calls the "
                                                  "model writes to this schema (a structural tag)")


    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON schema of type object")
        return v

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class _ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: _ChosenFunction


_TOOL_CHOICE_SCHEMA = {"anyOf": [{"type": "string", "enum": list(TOOL_CHOICE_MODES)},
                                 {"type": "object", "required": ["type", "function"],
                                  "properties": {"type": {"const": "function"},
                                                 "function": {"type": "object", "required": ["name"],
                                                              "properties": {"name": _NAME_SCHEMA}}}},
                                 {"type": "null"}]}
ToolChoiceField = Annotated[Any, WithJsonSchema(_TOOL_CHOICE_SCHEMA)]


def parse_tool_choice(value: Any) -> str | NamedToolChoice | None:
    """tool_choice as a mode or a named function; ValueError (a 400 naming `tool_choice`) otherwise."""
    if value is None or (isinstance(value, str) and value in TOOL_CHOICE_MODES):
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError:
            pass
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    arguments: str = Field(description="the arguments as a JSON object's text")


class AssistantToolCall(BaseModel):
    """One of an assistant message's `tool_calls`, as a client feeds back a call it executed."""

    model_config = ConfigDict(extra="ignore")
    id: Annotated[str, StringConstraints(min_length=1, max_length=MAX_CALL_ID_CHARS)]
    type: Literal["function"] = "function"
    function: CalledFunction


AssistantToolCalls = Annotated[list[AssistantToolCall], Field(max_length=MAX_TOOL_CALLS_PER_MESSAGE)]
ToolCallId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CALL_ID_CHARS)]
Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)]
