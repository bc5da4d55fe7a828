"""A request's prompt: its text, or its chat messages with the tools its chat template renders, into
token ids off the event loop; and the rest of tool calling, the grammar that forces a call and the
calls read back from the output.

Bounded before tokenizing: a token covers at most `max_token_chars`
characters (the longest entry in the vocabulary), so text longer than
`max_model_len * max_token_chars` characters cannot fit in the context and is
refused without being tokenized. A 20 MB prompt is a 400 in microseconds, not
36 s and 4 GB of tokenizer memory.

No lock is shared between requests: a fast tokenizer is not safe to share
across threads (the wrapper mutates its truncation state per call), so each
worker thread gets its own copy, and one tenant's long prompt never makes
another tenant's request wait for it.

Tool calling on /v1/chat/completions: from a request's `tools` and `tool_choice` to what the
chat template renders, the grammar that forces a call, and the calls in the response.

- `none`: the template sees the tools; the output is content only.
- `auto`: the model chooses; its calls are read by the --tool-call-parser family's format. With a
  `strict: true` function, a structural tag holds the calls it writes to their schemas
  (server.api.tool_call_tags).
- `required`: a grammar makes the output `[{"name": ..., "parameters": {...}}, ...]` over the
  offered functions, each call's parameters valid against its schema (one call only with
  parallel_tool_calls false).
- a named function: a grammar makes the output that function's arguments.
A forced (or strict) call is compiled like any structured-output constraint (bounded by --max-schema-bytes,
compiled under --max-grammar-compile-ms), so it cannot be combined with another one.
"""
from __future__ import annotations

import copy
import json
import re
import threading
from dataclasses import dataclass

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from starlette.concurrency import run_in_threadpool

from server.api.errors import APIError
from server.api.openai_requests import ChatCompletionRequest, Constraint, constraint_of
from server.api.token_text import TokenText
from server.api.tool_call_tags import strict_call_tag
from server.api.tool_parsers import FAMILY_PARSERS, ForcedArgumentsParser, ForcedArrayParser, Parsed, ToolOutputParser
from server.api.tool_requests import FunctionDefinition, NamedToolChoice
from server.engine import StructuredOutputsParams
from server.engine.tokenizer_loader import load_tokenizer


def longest_token_chars(tokenizer) -> int:
    """Characters the longest vocabulary entry can stand for (at least 1).

    Byte-level BPE entries are one character per byte, so their length bounds
    the characters they decode to; SentencePiece byte-fallback entries such as
    "<0x0A>" are longer than the one byte they encode, which only loosens the bound.
    """
    vocab = tokenizer.get_vocab()
    return max([1, *(len(token) for token in vocab)])


class PromptTokenizer:
    def __init__(self, model_dir: str, max_model_len: int, chat_template: str | None = None) -> None:
        self._template = load_tokenizer(model_dir)
        if chat_template is not None:  # --chat-template (server.chat_templates)
            self._template.chat_template = chat_template
        self._local = threading.local()
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_model_len * longest_token_chars(self._template)
        # The template itself is used on the event loop only (decoding never mutates it).
        self.token_texts = TokenText(self._template)

    def decode(self, ids: list[int]) -> str:
        """Token ids as text (event-loop thread only; at most a context's worth)."""
        return self._template.decode(ids)

    async def detokenize(self, ids: list[int]) -> str:
        """Any number of ids as text, on a worker thread with its own tokenizer."""
        return await run_in_threadpool(lambda: self._tok().decode(ids))

    def _tok(self):
        tok = getattr(self._local, "tok", None)
        if tok is None:
            tok = self._local.tok = copy.deepcopy(self._template)
        return tok

    def check_text_length(self, chars: int, what: str, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(400, f"{what} has {chars} characters; at most {self.max_prompt_chars} can fit in "
                                f"the maximum context length of {self.max_model_len} tokens",
                           "context_length_exceeded", param=param)

    def check_token_count(self, count: int, param: str) -> None:
        if count > self.max_model_len:
            raise APIError(400, f"the prompt has {count} tokens, more than the maximum context length of "
                                f"{self.max_model_len} tokens", "context_length_exceeded", param=param)

    def _encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok()(text, add_special_tokens=add_special_tokens).input_ids)

    @property
    def chat_template(self) -> str | dict | None:
        return getattr(self._template, "chat_template", None)

    def _encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        tok = self._tok()
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", "no_chat_template",
                           param="messages")
        try:
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception is the user's input error
            raise APIError(400, f"the chat template refused these messages: {e}", "invalid_messages",
                           param="messages") from None
        # The template writes the special tokens (BOS...) itself.
        return list(tok(text, add_special_tokens=False).input_ids)

    async def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            self.check_text_length(len(prompt), "the prompt", "prompt")
            ids = await run_in_threadpool(self._encode_text, prompt, add_special_tokens)
        else:
            ids = list(prompt)
        self.check_token_count(len(ids), "prompt")
        return ids

    async def encode_batch(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """`encode` for each prompt of a batch, with one worker-thread hop for all its texts, not one
        per prompt (64 hops cost the event loop and the engine's core more than 64 short encodes)."""
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            self.check_text_length(len(text), "the prompt", "prompt")
        encoded = iter(await run_in_threadpool(lambda: [self._encode_text(t) for t in texts]) if texts else ())
        batch = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
        for ids in batch:
            self.check_token_count(len(ids), "prompt")
        return batch

    async def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        chars = sum(_message_chars(m) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        self.check_text_length(chars, "the conversation", "messages")
        ids = await run_in_threadpool(self._encode_chat, messages, tools)
        self.check_token_count(len(ids), "messages")
        return ids


def _message_chars(message: dict) -> int:
    content = message.get("content")
    calls = len(json.dumps(message["tool_calls"])) if message.get("tool_calls") else 0
    if isinstance(content, str):
        return len(content) + calls
    return sum(len(part.get("text", "")) for part in content or ()) + calls


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}': {message}", "invalid_value", param=param)


@dataclass(frozen=True)
class ToolPlan:
    mode: str                                   # none | auto | required | named
    functions: tuple[FunctionDefinition, ...]
    parallel: bool                              # parallel_tool_calls (default true)
    parser: str                                 # --tool-call-parser, for auto
    named: str | None = None                    # the function tool_choice names

    def template_tools(self) -> list[dict]:
        """The tools as chat templates expect them (OpenAI's shape)."""
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions]

    def output_constraint(self) -> StructuredOutputsParams | None:
        """What the output must follow: a forced call's JSON schema, or under auto with a strict
        function the structural tag that holds the calls to their schemas; None otherwise."""
        if self.mode == "auto":
            if not any(f.strict for f in self.functions):
                return None
            return StructuredOutputsParams(structural_tag=strict_call_tag(self.parser, self.functions, self.parallel))
        schema = self.forced_schema()
        return None if schema is None else StructuredOutputsParams(json=schema)

    def forced_schema(self) -> dict | None:
        """The JSON schema the output must follow, when a call is forced."""
        if self.mode == "named":
            return next(f.parameters_schema for f in self.functions if f.name == self.named)
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters_schema},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in self.functions]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def new_parser(self) -> ToolOutputParser:
        """A parser for one choice's output (not for mode none: there the output is content)."""
        assert self.mode != "none"
        if self.mode == "named":
            return ForcedArgumentsParser(self.named)
        if self.mode == "required":
            return ForcedArrayParser()
        return FAMILY_PARSERS[self.parser](frozenset(f.name for f in self.functions), self.parallel)


def plan_tools(req: ChatCompletionRequest, parser: str | None, max_schema_bytes: int) -> ToolPlan | None:
    """The request's tool plan, or None without tools; a 400 naming the field for a function
    schema past --max-schema-bytes, a name given twice, a named choice that is not offered, or
    tool_choice auto when `parser` is None (--no-enable-auto-tool-choice)."""
    if not req.tools:
        return None
    seen: set[str] = set()
    for i, tool in enumerate(req.tools):
        f = tool.function
        if f.name in seen:
            raise _bad(f"tools[{i}].function.name", f"{f.name!r} is given twice")
        seen.add(f.name)
        size = len(json.dumps(f.parameters_schema, separators=(",", ":"), ensure_ascii=False).encode())
        if size > max_schema_bytes:
            raise _bad(f"tools[{i}].function.parameters", f"the schema is {size} bytes, over the limit of "
                                                          f"{max_schema_bytes} bytes (--max-schema-bytes)")
    choice = req.tool_choice
    functions = tuple(t.function for t in req.tools)
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in seen:
            raise _bad("tool_choice.function.name", f"{choice.function.name!r} is not one of the tools")
        return ToolPlan("named", functions, parallel, parser, choice.function.name)
    if (choice or "auto") == "auto" and parser is None:
        # vLLM's wording for the same request to a server started without the flag.
        raise _bad("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                  "to be set")
    return ToolPlan(choice or "auto", functions, parallel, parser)


def request_constraint(req: ChatCompletionRequest, plan: ToolPlan | None, max_schema_bytes: int) -> Constraint | None:
    """The structured-output constraint of the request: a forced (or strict) tool call's, or the one it asks for."""
    asked = constraint_of(req, max_schema_bytes)
    spec = plan.output_constraint() if plan is not None else None
    if spec is None:
        return asked
    if asked is not None:
        raise _bad(asked.param, "cannot be combined with tool_choice \"required\", a named function, or a "
                                "strict function under \"auto\", which constrain the output themselves")
    constraint = Constraint(spec, "tools")
    size = constraint.spec.schema_bytes
    if size > max_schema_bytes:
        raise _bad("tools", f"the tools' call schema is {size} bytes, over the limit of {max_schema_bytes} bytes "
                            "(--max-schema-bytes)")
    return constraint


def _references_tools(template: str) -> bool:
    try:
        ast = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return re.search(r"\btools\b", template) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def _templates(template: str | dict | None) -> list[str]:
    if isinstance(template, dict):
        return [t for t in template.values() if isinstance(t, str)]
    return [template] if isinstance(template, str) else []


def chat_inputs(req: ChatCompletionRequest, plan: ToolPlan | None,
                template: str | dict | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template; a 400 when the request carries tools, tool messages
    or tool calls that this model's template cannot render, or arguments that are not a JSON object."""
    messages = [m.for_template() for m in req.messages]
    uses_tools = plan is not None or any(m.role == "tool" or m.tool_calls for m in req.messages)
    texts = _templates(template)
    if uses_tools and texts and not any(_references_tools(t) for t in texts):
        param = "tools" if plan is not None else "messages"
        raise APIError(400, f"'{param}': this model's chat template cannot render tools (it does not reference "
                            "'tools'); tool calling needs a model whose template does", "unsupported", param=param)
    for i, m in enumerate(req.messages):
        if m.tool_call_id is not None:
            messages[i]["tool_call_id"] = m.tool_call_id
        if not m.tool_calls:
            continue
        if not any("tool_calls" in t for t in texts):
            raise APIError(400, f"'messages[{i}].tool_calls': this model's chat template cannot render an "
                                "assistant's tool calls", "unsupported", param=f"messages[{i}].tool_calls")
        calls = []
        for j, call in enumerate(m.tool_calls):
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise _bad(param, "must be a JSON object's text")
            # Templates render the arguments themselves (Qwen's `| tojson`): a dict, as transformers expects.
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": args}})
        messages[i]["tool_calls"] = calls
    return messages, (plan.template_tools() if plan is not None else None)


class ChoiceToolCalls:
    """One choice's tool calls: its parser, and the calls aggregated for the non-streamed body."""

    def __init__(self, parser: ToolOutputParser) -> None:
        self._parser = parser
        self._calls: dict[int, dict] = {}

    def absorb(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content, tool_calls delta items) for one text delta of the choice."""
        parsed = self._parser.feed(text)
        if finished:
            parsed.add(self._parser.finish())
        return parsed.content, self._aggregate(parsed)

    def _aggregate(self, parsed: Parsed) -> list[dict]:
        items = []
        for call in parsed.calls:
            item = call.as_dict()
            items.append(item)
            if call.id is not None:
                self._calls[call.index] = {"id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": call.arguments}}
            else:
                self._calls[call.index]["function"]["arguments"] += call.arguments
        return items

    def message(self, content: str) -> dict:
        out: dict = {"role": "assistant", "content": content}
        if self._calls:
            out["content"] = content or None
            out["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self._calls else reason
