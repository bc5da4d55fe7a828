"""Reading tool calls out of a chat completion's text as it streams.

Each parser is fed the text deltas of one choice and splits them into content and call
deltas (OpenAI's `delta.tool_calls` items: a call's index, id and name first, then argument
fragments). The non-streamed response is the same parser fed the same deltas, aggregated,
so a streamed call's concatenated arguments equal the non-streamed call's by construction.

- ForcedArgumentsParser: a named tool_choice; the grammar made the whole output the arguments.
- ForcedArrayParser: tool_choice required; the grammar made the output
  `[{"name": ..., "parameters": {...}}, ...]`, and each call's arguments are its raw
  `parameters` text, streamed character-exact as it is generated.
- HermesParser (`--tool-call-parser hermes`, Hermes/Qwen): `<tool_call>{"name", "arguments"}</tool_call>`
  blocks anywhere in the text; a call is emitted when its block closes.
- Llama3JsonParser (`--tool-call-parser llama3_json`): the output is one or more
  `{"name", "parameters"}` objects separated by `;` when it starts with `{`, else content.
Under tool_choice auto a block that is not a valid call of an offered function (bad JSON,
an unknown name, arguments that are not an object) stays content.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from server.config import TOOL_CALL_PARSERS

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class CallDelta:
    index: int
    arguments: str = ""
    id: str | None = None    # set on a call's first delta, with its name
    name: str | None = None

    def as_dict(self) -> dict:
        out: dict = {"index": self.index}
        function: dict = {}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, other: "Parsed") -> None:
        self.content += other.content
        for call in other.calls:
            self.fragment(call)

    def fragment(self, call: CallDelta) -> None:
        """Append, joining argument text onto the previous delta of the same call."""
        last = self.calls[-1] if self.calls else None
        if last is not None and call.id is None and last.index == call.index:
            last.arguments += call.arguments
        else:
            self.calls.append(call)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolOutputParser:
    """feed() each text delta, finish() once; both return what can be handed out now."""

    def __init__(self) -> None:
        self.calls_made = 0

    def _open_call(self, name: str) -> CallDelta:
        self.calls_made += 1
        return CallDelta(self.calls_made - 1, "", new_call_id(), name)

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        return Parsed()


class ForcedArgumentsParser(ToolOutputParser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if not self.calls_made:
            out.fragment(self._open_call(self._name))
        if text:
            out.fragment(CallDelta(0, text))
        return out

    def finish(self) -> Parsed:
        return self.feed("")


class ForcedArrayParser(ToolOutputParser):
    """A character scanner over grammar-valid (possibly cut-off) JSON: depth 1 is the array,
    depth 2 a call object, whose `parameters` value is captured verbatim."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self._in_string = self._escaped = False
        self._string = ""
        self._key: str | None = None
        self._expect_key = False
        self._capture_depth = 0  # > 0 while inside the current call's `parameters` value
        self._named = False      # the current call's header has been handed out
        self._held = ""          # arguments seen before the name (not with our schema's order)

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        for ch in text:
            if self._capture_depth:
                self._capture(ch, out)
            elif self._in_string:
                self._string_char(ch, out)
            elif ch == '"':
                self._in_string, self._string = True, ""
            elif ch == "[" and self._depth == 0:
                self._depth = 1
            elif ch == "{" and self._depth == 1:
                self._depth, self._key, self._expect_key, self._named = 2, None, True, False
            elif ch == "{" and self._depth == 2 and self._key == "parameters" and not self._expect_key:
                self._capture_depth = 1
                self._emit_args(ch, out)
            elif ch == ":" and self._depth == 2:
                self._expect_key = False
            elif ch == "," and self._depth == 2:
                self._expect_key = True
            elif ch == "}" and self._depth == 2:
                self._depth = 1
            elif ch == "]" and self._depth == 1:
                self._depth = 0
        return out

    def _emit_args(self, text: str, out: Parsed) -> None:
        if self._named:
            out.fragment(CallDelta(self.calls_made - 1, text))
        else:
            self._held += text

    def _capture(self, ch: str, out: Parsed) -> None:
        self._emit_args(ch, out)
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._capture_depth += 1
        elif ch in "}]":
            self._capture_depth -= 1

    def _string_char(self, ch: str, out: Parsed) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False
            if self._depth == 2:
                self._string_done(json.loads('"' + self._string + '"'), out)
            return
        self._string += ch

    def _string_done(self, value: str, out: Parsed) -> None:
        if self._expect_key:
            self._key = value
        elif self._key == "name" and not self._named:
            out.fragment(self._open_call(value))
            self._named = True
            if self._held:
                out.fragment(CallDelta(self.calls_made - 1, self._held))
                self._held = ""


class _ParsedCalls(ToolOutputParser):
    """What the family parsers share: turning one decoded JSON object into a call."""

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        super().__init__()
        self._names = names
        self._parallel = parallel

    def _call(self, obj, out: Parsed) -> bool:
        """Emit obj as a call if it is a valid call of an offered function; False if it is not."""
        if not isinstance(obj, dict) or obj.get("name") not in self._names:
            return False
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return False
        if not isinstance(args, dict):
            return False
        if self.calls_made and not self._parallel:
            return True  # parallel_tool_calls false: the first call only; later ones are dropped
        call = self._open_call(obj["name"])
        out.fragment(call)
        out.fragment(CallDelta(call.index, json.dumps(args, ensure_ascii=False)))
        return True


class HermesParser(_ParsedCalls):
    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        super().__init__(names, parallel)
        self._buf = ""
        self._in_call = False
        self._spaces = ""  # whitespace held back: dropped if a call follows it
        self._dropped = ""  # the whitespace before an open block, back if the block is no call

    def _content(self, text: str, out: Parsed) -> None:
        stripped = text.rstrip()
        if stripped:
            out.content += self._spaces + stripped
            self._spaces = text[len(stripped):]
        else:
            self._spaces += text

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        while True:
            if self._in_call:
                end = self._buf.find(HERMES_CLOSE)
                if end < 0:
                    return out
                self._close_call(self._buf[:end], out)
                self._buf, self._in_call = self._buf[end + len(HERMES_CLOSE):], False
                continue
            start = self._buf.find(HERMES_OPEN)
            if start >= 0:
                self._content(self._buf[:start], out)
                self._dropped, self._spaces = self._spaces, ""
                self._buf, self._in_call = self._buf[start + len(HERMES_OPEN):], True
                continue
            keep = _partial_suffix(self._buf, HERMES_OPEN)
            self._content(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def _close_call(self, body: str, out: Parsed, closed: bool = True) -> None:
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if not self._call(obj, out):
            self._spaces = self._dropped
            self._content(HERMES_OPEN + body + (HERMES_CLOSE if closed else ""), out)

    def finish(self) -> Parsed:
        out = Parsed()
        if self._in_call:  # cut off, or the model stopped before closing its block
            self._in_call = False
            self._close_call(self._buf, out, closed=False)
        else:
            self._content(self._buf, out)
        self._buf = ""
        if not self.calls_made:
            out.content += self._spaces
        self._spaces = ""
        return out


class Llama3JsonParser(_ParsedCalls):
    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        super().__init__(names, parallel)
        self._buf = ""
        self._mode: str | None = None  # None: undecided, "calls", "content"

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if self._mode == "content":
            out.content = text
            return out
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if not head:
                return out
            if not head.startswith("{"):
                self._mode, out.content, self._buf = "content", self._buf, ""
                return out
            self._mode, self._buf = "calls", head
        if "}" in text:
            self._drain(out)
        return out

    def _drain(self, out: Parsed) -> None:
        decoder = json.JSONDecoder()
        while True:
            rest = self._buf.lstrip().lstrip(";").lstrip()
            if not rest.startswith("{"):
                if rest:  # not a call: the rest is content
                    self._mode, self._buf = "content", ""
                    out.content += rest
                return
            try:
                obj, end = decoder.raw_decode(rest)
            except ValueError:
                return  # incomplete: wait for more
            if not self._call(obj, out):
                self._mode, self._buf = "content", ""
                out.content += rest
                return
            self._buf = rest[end:]

    def finish(self) -> Parsed:
        out = Parsed()
        if self._mode == "calls":
            self._drain(out)
            if self._buf.strip():  # an object cut off, or never closed
                out.content += self._buf
        elif self._mode is None:
            out.content = self._buf
        self._buf = ""
        return out


FAMILY_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
assert tuple(FAMILY_PARSERS) == TOOL_CALL_PARSERS


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag` (held back until it can't)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
