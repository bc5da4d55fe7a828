"""Post-processing: a step's results become RequestOutputs (OutputProcessor), with the incremental
detokenizer (IncrementalDetokenizer) and the stop-string search (StopChecker) it runs per token.

A step's results become RequestOutputs: tokens appended, text detokenised, stops found,
requests forked into their n choices and finished. Every per-request failure ends here too, and so
does every abort: the processor keeps the requests in flight.

A sequence that verified drafts (speculative decoding) appends its run token by token, as the plain
engine would over as many steps, so a stop (EOS, a stop id or string, max_tokens) inside the run ends it
there; its computed tokens then stop at its last accepted draft, and the blocks past them go back.
One output per sequence and step, as without drafts.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.engine.sampler import SampleFailure
from server.engine.sequence import RequestOutput, Sequence, SequenceStatus, TokenLogprobs
from server.engine.tokenizer_loader import bytes_to_unicode

if TYPE_CHECKING:
    from server.engine.model_runner import SeqResult
    from server.engine.scheduler import ScheduledBatch, Scheduler


log = logging.getLogger(__name__)


class OutputProcessor:
    """The engine's post-processing half: the requests in flight, and what each step makes of them."""

    def __init__(self, scheduler: Scheduler, detokenizer: IncrementalDetokenizer, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.scheduler = scheduler  # finishes sequences, forks choices, charges output tokens
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.seqs: dict[str, Sequence] = {}  # request id -> its choice 0, until every choice finished
        self.aborted: list[Sequence] = []  # choices aborted since the last step: its outputs report them

    @property
    def num_draft_tokens(self) -> int:
        """Drafts verified since start (the scheduler's speculative-decoding counters have the rest)."""
        return self.scheduler.spec_counters.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        return self.scheduler.spec_counters.num_accepted_tokens

    def add(self, seq: Sequence) -> None:
        """Track a new request by its choice 0 (the scheduler has it already)."""
        self.seqs[seq.request_id] = seq

    def abort(self, request_id: str) -> None:
        """Abort every unfinished choice of the request; the next step reports them."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        for choice in seq.group.seqs:
            if not choice.finished:
                self.scheduler.finish(choice)
                choice.finish_reason = "abort"
                self.aborted.append(choice)

    def postprocess(self, batch: ScheduledBatch, results: dict[int, SeqResult]) -> list[RequestOutput]:
        outputs = [self._output(seq) for seq in self.aborted]
        self.aborted.clear()
        for seq, error in batch.failed:
            outputs += self._fail(seq, f"adapter {seq.version_id} could not be loaded: {error}")
        register, finished = self.scheduler.prefix_cache.register, SequenceStatus.FINISHED
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if seq.status is finished:
                continue  # async scheduling: aborted, or ended by the step before, while this one ran
            result = results.get(i)
            if result is None:  # a prompt chunk
                seq.num_computed_tokens += n
                register(seq)
                continue
            if result.done:
                seq.proposed = result.proposed
            if result.drafted:
                self._advance_run(outputs, seq, n - result.drafted, result)
                continue
            seq.num_computed_tokens += n
            # Blocks this step filled are computed now, so others may reuse them (before a fork copies
            # the sequence's progress to its siblings).
            register(seq)
            if result.prompt_logprobs:
                seq.group.prompt_logprobs += result.prompt_logprobs
            if not result.done:
                continue  # a prompt chunk: nothing to say yet
            if not result.tokens:
                outputs += self._finish(seq, "length")  # scoring only: the prompt's logprobs are the answer
                continue
            if seq.group.needs_fork:  # its prompt is in: the other choices start, each with its token
                for choice, token, logprob in zip([seq, *self.scheduler.fork(seq)], result.tokens, result.logprobs):
                    self._advance(outputs, choice, token, logprob)
            else:
                self._advance(outputs, seq, result.tokens[0], result.logprobs[0])
        return outputs

    def _advance_run(self, outputs: list[RequestOutput], seq: Sequence, n: int, result: SeqResult) -> None:
        """`seq` ran n tokens and its drafts; `result.tokens` are its accepted drafts and the target's token."""
        self.scheduler.verified(seq, result.drafted, len(result.tokens) - 1)
        mark = len(outputs)
        for j, (token, logprob) in enumerate(zip(result.tokens, result.logprobs)):
            # Before each token, what precedes it is in the KV: the pending tokens, then each accepted draft.
            seq.num_computed_tokens += n if j == 0 else 1
            self.scheduler.prefix_cache.register(seq)
            self._advance(outputs, seq, token, logprob)
            if seq.finished:
                break
        else:
            self.scheduler.roll_back(seq)
        outputs[mark:] = outputs[-1:]

    def _advance(self, outputs: list[RequestOutput], seq: Sequence, token: int | SampleFailure,
                 logprob: TokenLogprobs | None) -> None:
        """Append `seq`'s next token (or fail it) and its output to `outputs`."""
        if isinstance(token, SampleFailure):
            outputs += self._fail(seq, self._failure_message(seq, token))
            return
        try:
            outputs.append(self._append_token(seq, token, logprob))
        except Exception as e:  # noqa: BLE001 - one request's failure, never the engine's
            log.exception("post-processing request %s failed", seq.request_id)
            outputs += self._fail(seq, f"post-processing failed: {type(e).__name__}: {e}")

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> RequestOutput:
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")
        ids = seq.token_ids
        ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprob)
        self.scheduler.waiting.charge_output(seq)
        seq.text += self.detokenizer.step(seq.detok_state, ids)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            if seq.text_cut is None:
                seq.text += self.detokenizer.flush(seq.detok_state, ids)
            self._finish(seq, reason)
        return self._output(seq)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> list[RequestOutput]:
        """End `seq`; before its request forked, the choices still waiting on it end alike."""
        group = seq.group
        ended = group.seqs if group.needs_fork else [seq]
        for s in ended:
            s.finish_reason, s.error = reason, error
            if not s.finished:
                self.scheduler.finish(s)
        if group.finished:
            self.seqs.pop(seq.request_id, None)
        return [s.output() for s in ended]

    def _fail(self, seq: Sequence, message: str) -> list[RequestOutput]:
        """Finish with finish_reason "error": every per-request failure ends here."""
        return self._finish(seq, "error", message)

    @staticmethod
    def _failure_message(seq: Sequence, failure: SampleFailure) -> str:
        if not failure.non_finite:
            return failure.reason
        source = f"adapter {seq.version_id}" if seq.version_id is not None else "the base model"
        return f"{source} {failure.reason}"

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.grammar is not None and seq.grammar.is_terminated():
            # The constraint is complete (it ended on a stop token, even with ignore_eos), before
            # min_tokens too: its grammar allowed nothing else (vLLM's rule, vllm#54218).
            return "stop"
        if p.min_tokens and seq.num_output_tokens < p.min_tokens:
            # vLLM: no stop token or string ends a choice before min_tokens (the sampler masks the
            # tokens), and a stop string wholly inside that text never ends it later.
            seq.stop.skip(seq.text)
            return None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.stop.stops:
            cut = seq.stop.find(seq.text)
            if cut is not None:
                seq.text = seq.text[:cut]
                seq.text_cut = cut
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        stop = seq.stop
        if stop.stops and not seq.finished:
            # Hold back a tail that could still grow into a stop string, so it is never streamed.
            return seq.output(seq.text[: len(seq.text) - stop.partial_suffix(seq.text)])
        return seq.output()


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
