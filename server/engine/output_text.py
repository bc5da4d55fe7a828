"""Text for the engine's token outputs, on the front end's side: incremental detokenizing and stop
strings (vLLM V1's OutputProcessor and IncrementalDetokenizer, in its API process).

The engine's outputs carry token ids only (server.engine.output_processor); every mode turns them into
text here, one implementation: the in-process and engine-core clients' request sinks
(server.engine.async_engine.Sink) and the LLM API (OutputTexts). Per choice (ChoiceText), each new
token's text is appended and the stop strings searched after it, as the engine once did per token: a
stop string ends the choice at the token that completed it (its text cut where the string starts,
token ids and logprobs after that token dropped, so usage counts up to that token), and that choice is
aborted back to the engine at once (server.engine.choice_abort: its other choices run on), which stops
spending steps and KV on it and takes back the tokens it ran past the stop from the tenant's fair share.
While a choice runs, a tail that could still grow into a stop string is held back, so it is never streamed.

Incremental detokenisation (IncrementalDetokenizer): text grows as tokens arrive, multi-byte characters come out whole.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2, the demo model) get a fast
path: each token's bytes come from a table built once, and an incremental
UTF-8 decoder holds back a character split across tokens. Other tokenizers
decode a short window twice per step (with and without the newest tokens):
a window rather than single tokens keeps tokenizers that merge spaces across
tokens right, and a trailing U+FFFD means the newest token ends mid-character,
so the text waits.

Stop strings (StopChecker): where the text must end, and how much of its tail to hold back while streaming.
"""
from __future__ import annotations

import codecs
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from server.engine.choice_abort import ChoiceAbort
from server.engine.sequence import RequestOutput, SamplingParams
from server.engine.tokenizer_loader import bytes_to_unicode

log = logging.getLogger(__name__)


class ChoiceText:
    """One choice's text so far, from the engine's cumulative token outputs."""

    __slots__ = ("detokenizer", "params", "state", "stop", "ids", "text", "ended")

    def __init__(self, detokenizer: IncrementalDetokenizer, params: SamplingParams) -> None:
        self.detokenizer = detokenizer
        self.params = params
        self.state = detokenizer.new_state()
        self.stop = StopChecker(params.stop)
        self.ids: list[int] = []  # the output tokens read so far
        self.text = ""
        self.ended = False  # its last output was given: later ones (an abort's) are dropped

    def apply(self, out: RequestOutput) -> RequestOutput | None:
        """`out` with its text (changed in place); None once the choice has ended here."""
        if self.ended:
            return None
        tokens, ids, det, stop = out.token_ids, self.ids, self.detokenizer, self.stop
        # The engine's own stop (a finished grammar, EOS, a stop id) came before stop strings on its
        # last token, as it always did: that token's text is not searched.
        engine_stop = out.finished and out.finish_reason != "length"
        min_tokens = self.params.min_tokens
        for k in range(len(ids), len(tokens)):
            ids.append(tokens[k])
            self.text += det.step(self.state, ids)
            if not stop.stops or (engine_stop and k == len(tokens) - 1):
                continue
            if len(ids) < min_tokens:
                # vLLM: no stop string ends a choice before min_tokens, and one wholly inside that
                # text never ends it later.
                stop.skip(self.text)
                continue
            cut = stop.find(self.text)
            if cut is not None:
                return self._stopped(out, cut, len(ids))
        if out.finished:
            self.ended = True
            if out.finish_reason in ("stop", "length"):
                self.text += det.flush(self.state, ids)
            out.text = self.text
        elif stop.stops:
            out.text = self.text[: len(self.text) - stop.partial_suffix(self.text)]
        else:
            out.text = self.text
        return out

    def failed(self, out: RequestOutput, message: str) -> RequestOutput:
        """The choice ends with finish_reason "error" before the token whose text failed (the last one
        read: a token is read, then detokenized)."""
        return self._end(out, max(0, len(self.ids) - 1), "error", message)

    def _stopped(self, out: RequestOutput, cut: int, kept: int) -> RequestOutput:
        """A stop string starting at `cut` ended the text at output token `kept`."""
        self.text = self.text[:cut]
        return self._end(out, kept, "stop", None)

    def _end(self, out: RequestOutput, kept: int, reason: str, error: str | None) -> RequestOutput:
        self.ended = True
        out.text, out.finished, out.finish_reason, out.error = self.text, True, reason, error
        del out.token_ids[kept:]
        if out.logprobs is not None:
            del out.logprobs[kept:]
        return out


class RequestText:
    """A request's choices' texts; `abort_choice` ends a choice in the engine once it ended here (a stop
    string, or its text failed) while the engine still ran it."""

    __slots__ = ("choices", "abort_choice")

    def __init__(self, detokenizer: IncrementalDetokenizer, params: SamplingParams,
                 abort_choice: Callable[[ChoiceAbort], None]) -> None:
        self.choices = [ChoiceText(detokenizer, params) for _ in range(params.n)]
        self.abort_choice = abort_choice

    def apply(self, out: RequestOutput) -> RequestOutput | None:
        choice = self.choices[out.index]
        engine_finished = out.finished
        try:
            out = choice.apply(out)
        except Exception as e:  # noqa: BLE001 - one request's failure (a detokenizer bug), never the others'
            log.exception("detokenizing request %s failed", out.request_id)
            out = choice.failed(out, f"post-processing failed: {type(e).__name__}: {e}")
        if out is None:
            return None
        if out.finished and not engine_finished:  # the engine still runs it: no more steps or KV for it
            self.abort_choice(ChoiceAbort(out.request_id, out.index, len(out.token_ids)))
        return out


class OutputTexts:
    """The LLM API's front end over an LLMEngine it steps itself: each request's text by request id."""

    def __init__(self, detokenizer: IncrementalDetokenizer, abort_choice: Callable[[ChoiceAbort], None]) -> None:
        self.detokenizer = detokenizer
        self._abort_choice = abort_choice  # LLMEngine.abort_choice
        self._requests: dict[str, RequestText] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        self._requests[request_id] = RequestText(self.detokenizer, params, self._abort_choice)

    def apply(self, outputs: Iterable[RequestOutput]) -> list[RequestOutput]:
        """The outputs with their text; an output after its choice ended here is dropped."""
        texted = []
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:
                continue
            out = request.apply(out)
            if out is None:
                continue
            texted.append(out)
            if out.finished and all(c.ended for c in request.choices):
                del self._requests[out.request_id]
        return texted


NOT_BYTE_LEVEL = 0xFFFF  # a character Latin-1 cannot encode: marks a piece that is not byte-level


@dataclass
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0
    utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.token_bytes = self._byte_table()  # id -> bytes, or None when not byte-level
        # id -> its bytes decoded when they are whole UTF-8 characters (None: a partial one)
        self.token_text = None if self.token_bytes is None else [_whole_text(b) for b in self.token_bytes]

    def new_state(self, start: int = 0) -> DetokState:
        """State for a sequence whose first `start` ids (the prompt) are not to be decoded."""
        return DetokState(prefix_offset=start, read_offset=start)

    def step(self, state: DetokState, output_ids: list[int]) -> str:
        """New text made final by the ids appended since the last call (updates `state`).

        `output_ids` is the sequence's whole id list; only ids from the state's offsets on are read.
        """
        if self.token_bytes is not None:
            table, n = self.token_bytes, len(self.token_bytes)
            read, state.read_offset = state.read_offset, len(output_ids)
            if len(output_ids) == read + 1:  # the usual decode step
                t = output_ids[read]
                if not 0 <= t < n:
                    return state.utf8.decode(b"")
                text = self.token_text[t]
                # Nothing held back and the token's bytes are whole characters: what the decoder would give.
                if text is not None and not state.utf8.buffer:
                    return text
                return state.utf8.decode(table[t])
            new = output_ids[read:]
            return state.utf8.decode(b"".join(table[t] if 0 <= t < n else b"" for t in new))
        prefix, full = self._window(state, output_ids)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        state.prefix_offset, state.read_offset = state.read_offset, len(output_ids)
        return full[len(prefix) :]

    def flush(self, state: DetokState, output_ids: list[int]) -> str:
        """At the end of a sequence: whatever text is still held back, incomplete characters included."""
        if self.token_bytes is not None:
            return self.step(state, output_ids) + state.utf8.decode(b"", final=True)
        prefix, full = self._window(state, output_ids)
        state.prefix_offset = state.read_offset = len(output_ids)
        return full[len(prefix) :]

    def _window(self, state: DetokState, output_ids: list[int]) -> tuple[str, str]:
        """The window's text without and with the ids not yet read."""
        decode = self.tokenizer.decode
        prefix = decode(output_ids[state.prefix_offset : state.read_offset], skip_special_tokens=self.skip)
        return prefix, decode(output_ids[state.prefix_offset :], skip_special_tokens=self.skip)

    def _byte_table(self) -> list[bytes] | None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or type(backend.decoder).__name__ != "ByteLevel":
            return None
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return None  # decode() would also rewrite spaces; keep its exact output
        # Each byte-level character to the Latin-1 character of its byte, so a whole piece converts in C
        # (str.translate, then encode): ~0.1 s for a 49k vocabulary, not the ~0.9 s of a per-character
        # loop at every start. A Latin-1 character that is not a byte-level one (a space, a control
        # character) goes to one that Latin-1 cannot encode, as any other character does.
        to_latin1 = {ord(c): b for b, c in bytes_to_unicode().items()}
        for code in range(256):
            to_latin1.setdefault(code, NOT_BYTE_LEVEL)
        special = set(self.tokenizer.all_special_ids) if self.skip else set()
        added = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items()}
        table: list[bytes] = []
        for i, piece in enumerate(self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))):
            if i in special or piece is None:
                table.append(b"")
            elif i in added:
                table.append(added[i].encode())
            else:
                try:
                    table.append(piece.translate(to_latin1).encode("latin-1"))
                except UnicodeEncodeError:
                    return None  # not a pure byte-level vocabulary
        return table


def _whole_text(piece: bytes) -> str | None:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


class StopChecker:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.searched = 0  # text before this offset holds no stop string

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string starts, or None."""
        if not self.stops:
            return None  # the common case: one attribute check per token
        start = max(0, self.searched - self.longest + 1)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        self.searched = len(text)
        return min(hits) if hits else None

    def skip(self, text: str) -> None:
        """`text` is not to be searched (min_tokens not reached): later searches start at its end,
        less a stop string's length, so only a stop string that ends after it counts."""
        self.searched = len(text)

    def partial_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
