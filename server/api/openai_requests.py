"""Requests of the OpenAI-compatible endpoints: their bodies as pydantic models, and what the engine
is asked from them (SamplingParams, the structured-output constraint).

Constraints live in the models (ranges, lengths, enums) and are published in
/openapi.json. Every top-level field is declared: an unknown one is refused with a
400 naming it (server.api.body; the operator's --lenient-request-fields
drops it and says so in a response header). Fields OpenAI clients send that change
nothing here (`user`, `metadata`, `service_tier` "auto" or "default") are accepted
as they are; fields we know and cannot honour are refused with a 400 naming them
(`Unsupported`), never accepted and silently ignored.

From a validated OpenAI request to the engine's SamplingParams: defaults, caps and the
translations between the two vocabularies (OpenAI's top_k -1, logprobs as a count or a flag).

A request's structured-output constraint, from any of the ways clients ask for one:
OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs`
object, or its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
At most one way per request; the constraint is bounded (--max-schema-bytes) here,
before anything compiles it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema, field_validator, model_validator
from starlette.concurrency import run_in_threadpool

from server.api.errors import APIError
from server.api.token_id_lists import TOKEN_ID_MAX, TOKEN_ID_MIN, TokenIdField
from server.api.tool_requests import (AssistantToolCalls, NamedToolChoice, ToolCallId, ToolChoiceField, Tools,
                                      parse_tool_choice)
from server.engine import SamplingParams, StructuredOutputsParams
from server.engine.grammar import GrammarError
from server.engine.grammar_worker import GrammarCompileService, GrammarCompilerBusy, GrammarTimeout
from tenants import Tenant

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 4096
MAX_NAME_CHARS = 256
MAX_DETOKENIZE_IDS = 1 << 20
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

ModelId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]
# x-token-id: server.api.openapi publishes the served model's vocabulary as the bound.
TokenId = Annotated[int, Field(ge=TOKEN_ID_MIN, le=TOKEN_ID_MAX, json_schema_extra={"x-token-id": True})]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class Unsupported(ValueError):
    """A known field set to a value loraplex cannot honour; the HTTP layer answers 400 naming it."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"'{field}' {why}")
        self.field = field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk; refused if true


class SamplingFields(BaseModel):
    """What completions and chat share: OpenAI's sampling fields plus vLLM's extras."""

    model_config = ConfigDict(extra="forbid")

    model: ModelId
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=1024)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    user: Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)] | None = None
    # OpenAI's request annotations: they change no output, so accepting them honours them.
    metadata: Annotated[dict[str, Annotated[str, StringConstraints(max_length=512)]],
                        Field(max_length=16)] | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    store: bool | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, le=(1 << 31) - 1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0, le=(1 << 31) - 1)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    prompt_logprobs: TopLogprobs | None = None
    priority: Annotated[int, Field(ge=-(1 << 31), le=(1 << 31) - 1)] = 0
    cache_salt: Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)] | None = Field(
        None, description="vLLM's: only requests with the same salt (and tenant and adapter) share cached "
                          "prompt blocks")
    # Ours: false keeps this request out of speculative decoding (docs/speculative-decoding.md); the output is
    # the same either way.
    speculative: bool = True
    # LoRAX's per-request adapter (server.api.adapter_references.resolve_lorax_adapter)
    adapter_id: Annotated[str, StringConstraints(min_length=1, max_length=2048)] | None = None
    adapter_source: Annotated[str, StringConstraints(min_length=1, max_length=16)] | None = None
    # vLLM fields we know but do not implement: set to anything but their default, they are refused.
    use_beam_search: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Structured output (server.api.openai_requests reads and bounds them): vLLM's fields.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with OpenAI's string keys as token ids (checked: decimal, in range)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise Unsupported("logit_bias", f"keys must be token ids, got {key!r}")
            out[int(key)] = value
        return out

    def refuse_unsupported(self) -> None:
        """Raise Unsupported for the first field set to a value we cannot honour."""
        defaults = {"use_beam_search": False, "length_penalty": 1.0, "include_stop_str_in_output": False,
                    "skip_special_tokens": True, "spaces_between_special_tokens": True,
                    "truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": None}
        for field, default in defaults.items():
            if getattr(self, field) != default:
                raise Unsupported(field, "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise Unsupported("best_of", "other than n is not supported")
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "is only allowed with stream: true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise Unsupported("stream_options.continuous_usage_stats", "is not supported: usage comes in the "
                                                                        "last chunk (include_usage)")
        if self.store:
            raise Unsupported("store", "true is not supported: loraplex stores no completions")
        if self.service_tier not in (None, "auto", "default"):
            raise Unsupported("service_tier", f"{self.service_tier!r} is not supported: one tier serves "
                                              f"everyone (use priority)")


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt` is a string, token ids, or a batch of either."""

    TOKEN_ID_FIELDS: ClassVar[dict[str, TokenIdField]] = {"prompt": TokenIdField(batch=True)}

    prompt: (Annotated[str, StringConstraints(min_length=0)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    # Not an OpenAI completions field: refused if set (and published as null only).
    max_completion_tokens: Annotated[int | None, WithJsonSchema({"type": "null"})] = None

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise Unsupported("suffix", "is not supported")
        if self.max_completion_tokens is not None:
            raise Unsupported("max_completion_tokens", "is a chat completions field; use max_tokens")
        if self.max_tokens == 0 and not self.echo:
            raise Unsupported("max_tokens", "of 0 is only allowed with echo: true (scoring the prompt)")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class MediaPart(BaseModel):
    """An image, audio, video or file content part: known, and refused (the models served read text only)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "video_url", "audio_url", "image", "audio"]


ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)] | None = None
    tool_calls: AssistantToolCalls | None = None
    tool_call_id: ToolCallId | None = None

    def for_template(self) -> dict:
        """The message as the chat template sees it ("developer" is OpenAI's new name for "system");
        tool calls and ids by server.api.prompts.tool_message_fields."""
        role = "system" if self.role == "developer" else self.role
        content = self.content if isinstance(self.content, str) or self.content is None else \
            [part.model_dump() for part in self.content]
        out: dict = {"role": role, "content": content if content is not None else ""}
        if self.name is not None:
            out["name"] = self.name
        return out

    def refuse_media(self, index: int) -> None:
        """Unsupported for a content part other than text, naming where it is."""
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if isinstance(part, MediaPart):
                raise Unsupported(f"messages[{index}].content[{j}]",
                                  f"is a {part.type!r} part: images, audio, video and files are not supported "
                                  f"(loraplex serves text-only language models); send text parts")


def refuse_media(messages: list[ChatMessage] | None) -> None:
    for i, message in enumerate(messages or ()):
        message.refuse_media(i)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    # Tool calling (server.api.prompts plans it; server.api.tool_requests bounds it).
    tools: Tools | None = None
    tool_choice: ToolChoiceField = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated forms of tools/tool_choice: refused, naming their replacements.
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM chat extras we do not implement
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    reasoning_effort: str | None = None
    prediction: Any = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> str | NamedToolChoice | None:
        return parse_tool_choice(value)

    @model_validator(mode="after")
    def _max_tokens(self) -> "ChatCompletionRequest":
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be at least 1 in chat completions")
        return self

    @property
    def completion_limit(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) wins over the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for field in ("functions", "function_call"):
            if getattr(self, field) is not None:
                raise Unsupported(field, "is OpenAI's deprecated form and is not supported: use 'tools' and "
                                         "'tool_choice'")
        for field in ("chat_template", "chat_template_kwargs", "documents", "audio", "prediction",
                      "reasoning_effort"):
            if getattr(self, field):
                raise Unsupported(field, "is not supported")
        if not self.tools:
            for field in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, field) is not None:
                    raise Unsupported(field, "is only allowed when 'tools' are given")
        if self.modalities not in (None, ["text"]):
            raise Unsupported("modalities", "other than [\"text\"] are not supported")
        for flag, default in (("echo", False), ("add_generation_prompt", True), ("continue_final_message", False)):
            if getattr(self, flag) != default:
                raise Unsupported(flag, "is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs", "needs logprobs: true")
        refuse_media(self.messages)
        for i, m in enumerate(self.messages):
            if m.role == "function":
                raise Unsupported(f"messages[{i}].role", "'function' is OpenAI's deprecated form: use 'tool' "
                                                         "messages with a tool_call_id")
            if m.tool_calls and m.role != "assistant":
                raise Unsupported(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
            if (m.role == "tool") != (m.tool_call_id is not None):
                raise Unsupported(f"messages[{i}].tool_call_id", "is required on tool messages, and only there")


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt or chat messages."""

    # Published as the validator below reads: exactly one of the two, not null.
    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    model: ModelId
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self

    def refuse_unsupported(self) -> None:
        refuse_media(self.messages)


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    TOKEN_ID_FIELDS: ClassVar[dict[str, TokenIdField]] = {"tokens": TokenIdField(max_items=MAX_DETOKENIZE_IDS)}
    model: ModelId
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_IDS)]


COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def max_tokens_for(req: CompletionRequest | ChatCompletionRequest, tenant: Tenant, prompt_len: int,
                   max_model_len: int) -> int:
    """The completion's token limit: as asked, else the endpoint's default (chat: the rest of the
    context, within the tenant's own caps, shared by the n choices of the token budget)."""
    if isinstance(req, CompletionRequest):
        return req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    if req.completion_limit is not None:
        return req.completion_limit
    room = max_model_len - prompt_len
    q = tenant.quota
    if q.max_tokens_per_request is not None:
        room = min(room, q.max_tokens_per_request // req.n)  # the cap bounds all n choices together
    if q.tokens_per_minute is not None:
        room = min(room, (q.tokens_per_minute - prompt_len) // req.n)
    return max(1, room)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, vocab_size: int,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    try:
        bias = req.token_bias()
    except Unsupported as e:
        raise APIError(400, str(e), "invalid_value", param=e.field) from None
    if bias and max(bias) >= vocab_size:
        raise APIError(400, f"'logit_bias' names token {max(bias)}, outside the vocabulary of {vocab_size}",
                       "invalid_value", param="logit_bias")
    if isinstance(req, CompletionRequest):
        logprobs = req.logprobs
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
        if req.echo and max_tokens == 0 and prompt_logprobs is None:
            # vLLM's echo with max_tokens 0: the prompt comes back as the text. The engine runs such a
            # request only as scoring, so it scores the prompt (no alternatives); nothing of it is returned.
            prompt_logprobs = 0
    else:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = req.prompt_logprobs
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=max(0, req.top_k), min_p=req.min_p, seed=req.seed, stop=req.stop_strings,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, n=req.n,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, logit_bias=bias,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs,
            speculative=req.speculative)
    except ValueError as e:
        # SamplingParams' messages begin with the field's name.
        raise APIError(400, str(e), "invalid_value", param=str(e).split(" ", 1)[0]) from None


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
