"""Post-processing: a step's results become RequestOutputs (OutputProcessor).

A step's results become RequestOutputs: tokens appended, stops found, requests forked into their n
choices and finished. Every per-request failure ends here too, and so does every abort: the processor
keeps the requests in flight.

The outputs carry token ids (and logprobs), never text: detokenizing and stop strings are the front
end's (server.engine.output_text, as vLLM V1's API process does them), off the engine's step. The
stops here are those the tokens decide: a finished grammar, EOS, a stop token id, max_tokens, the
model's length. A stop string the front end finds aborts its choice back to the engine
(server.engine.choice_abort): the choice stops, and the tokens it ran past the stop are taken back from
its tenant's fair share, the request's other choices running on. A request that ended here before that
abort arrived is remembered (its tenant and each choice's output tokens, the last ENDED_KEPT requests) so
the late abort takes them back all the same.

A sequence that verified drafts (speculative decoding) appends its run token by token, as the plain
engine would over as many steps, so a stop (EOS, a stop id, max_tokens) inside the run ends it there;
its computed tokens then stop at its last accepted draft, and the blocks past them go back. One output
per sequence and step, as without drafts.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.engine.choice_abort import ChoiceAbort
from server.engine.sampler import SampleFailure
from server.engine.sequence import RequestOutput, Sequence, SequenceStatus, TokenLogprobs

if TYPE_CHECKING:
    from server.engine.model_runner import SeqResult
    from server.engine.scheduler import ScheduledBatch, Scheduler


log = logging.getLogger(__name__)

# Requests ended here that a front end's ChoiceAbort may still reach (it left after a step's outputs, so
# it trails them by a few steps): far more than end in that time.
ENDED_KEPT = 4096


@dataclass
class _Ended:
    """What a request that ended here ran: whose it was and each choice's output tokens (None once a
    ChoiceAbort took back what it ran past its client's tokens)."""

    tenant: str | None
    outputs: list[int | None]


class OutputProcessor:
    """The engine's post-processing half: the requests in flight, and what each step makes of them."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.scheduler = scheduler  # finishes sequences, forks choices, charges output tokens
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.seqs: dict[str, Sequence] = {}  # request id -> its choice 0, until every choice finished
        self.aborted: list[Sequence] = []  # choices aborted since the last step: its outputs report them
        self.ended: OrderedDict[str, _Ended] = OrderedDict()  # the last ENDED_KEPT requests ended here
        self.taken_back: set[Sequence] = set()  # running requests' choices a ChoiceAbort uncharged already

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
        seq = self.seqs.get(request_id)
        if seq is None:
            return
        for choice in seq.group.seqs:
            self._abort(choice)
        self._ended(seq)

    def abort_choice(self, abort: ChoiceAbort) -> None:
        """The front end ended one choice after `abort.kept` output tokens (a stop string): it stops here too,
        its siblings running on, and the tokens it ran past them are taken back from its tenant's fair share.
        A choice it does not name (another index, an unknown request) is ignored."""
        kept = max(abort.kept, 0)  # never more taken back than the choice ran
        seq = self.seqs.get(abort.request_id)
        if seq is None:
            ended = self.ended.get(abort.request_id)
            if ended is not None and 0 <= abort.index < len(ended.outputs) and ended.outputs[abort.index]:
                self.scheduler.waiting.uncharge_output(ended.tenant, ended.outputs[abort.index] - kept)
                ended.outputs[abort.index] = None
            return
        if not 0 <= abort.index < len(seq.group.seqs):
            return
        choice = seq.group.seqs[abort.index]
        if choice not in self.taken_back:
            self.scheduler.waiting.uncharge_output(choice.tenant, choice.num_output_tokens - kept)
            self.taken_back.add(choice)
        self._abort(choice)
        if seq.group.finished:
            self._ended(seq)

    def _abort(self, choice: Sequence) -> None:
        if not choice.finished:
            self.scheduler.finish(choice)
            choice.finish_reason = "abort"
            self.aborted.append(choice)

    def _ended(self, seq: Sequence) -> None:
        """`seq`'s request ended here: remembered for a ChoiceAbort still on its way."""
        del self.seqs[seq.request_id]
        outputs: list[int | None] = []
        for choice in seq.group.seqs:
            outputs.append(None if choice in self.taken_back else choice.num_output_tokens)
            self.taken_back.discard(choice)
        self.ended[seq.request_id] = _Ended(seq.tenant, outputs)
        if len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def postprocess(self, batch: ScheduledBatch, results: dict[int, SeqResult]) -> list[RequestOutput]:
        outputs = [seq.output() for seq in self.aborted]
        self.aborted.clear()
        for seq, error in batch.failed:
            outputs += self._fail(seq, f"adapter {seq.version_id} could not be loaded: {error}")
        cache, finished = self.scheduler.prefix_cache, SequenceStatus.FINISHED
        register = cache.register
        # A decode row fills its last block a token at a time: the cache is called only once one is full.
        block_size = cache.block_size if cache.enabled else 0
        charged: dict[str | None, int] = {}  # tenant -> output tokens of the plain rows, charged once
        max_model_len, eos = self.max_model_len, self.eos_token_ids
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if seq.status is finished:
                continue  # async scheduling: aborted, or ended by the step before, while this one ran
            result = results.get(i)
            if result is not None and result.only_token and seq.grammar is None and seq.logprobs is None:
                # The usual decode row, inline: what the general path below and _append_token make of it.
                try:
                    seq.proposed = ()
                    seq.num_computed_tokens += n
                    if block_size and seq.num_computed_tokens // block_size > seq.num_registered_blocks:
                        register(seq)
                    token, ids, p = result.tokens[0], seq.token_ids, seq.params
                    ids.append(token)
                    charged[seq.tenant] = charged.get(seq.tenant, 0) + 1
                    # No stop possible (the usual token): below both lengths, not a stop id, not an EOS that
                    # ends it; else _token_stop decides (min_tokens included).
                    if (len(ids) - seq.num_prompt_tokens < p.max_tokens and len(ids) < max_model_len
                            and token not in p.stop_token_ids and (p.ignore_eos or token not in eos)):
                        outputs.append(seq.output())
                    else:
                        reason = self._token_stop(seq, token)
                        outputs += [seq.output()] if reason is None else self._finish(seq, reason)
                except Exception as e:  # noqa: BLE001 - one request's failure, never the engine's
                    outputs += self._failed(seq, e)
                continue
            if result is None:  # a prompt chunk
                seq.num_computed_tokens += n
                register(seq)
                continue
            if result.done:
                seq.proposed = result.proposed
            if result.drafted:
                self._advance_run(outputs, seq, n - result.drafted, result)
                self._refill(seq)
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
                    self._refill(choice)
            else:
                self._advance(outputs, seq, result.tokens[0], result.logprobs[0])
                self._refill(seq)
        if charged:
            self.scheduler.waiting.charge_outputs(charged)
            self.scheduler.num_generated_tokens += sum(charged.values())  # as _append_token counts each
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

    def _refill(self, seq: Sequence) -> None:
        """A constrained choice that took this step's tokens: its next masks start filling, for the drafts
        its next step may verify too (server.engine.mask_lane)."""
        if seq.grammar is not None and not seq.finished:
            seq.grammar.refill(self.scheduler.next_drafts(seq))

    def _advance(self, outputs: list[RequestOutput], seq: Sequence, token: int | SampleFailure,
                 logprob: TokenLogprobs | None) -> None:
        """Append `seq`'s next token (or fail it) and its output to `outputs`."""
        if isinstance(token, SampleFailure):
            outputs += self._fail(seq, self._failure_message(seq, token))
            return
        try:
            outputs.append(self._append_token(seq, token, logprob))
        except Exception as e:  # noqa: BLE001 - one request's failure, never the engine's
            outputs += self._failed(seq, e)

    def _failed(self, seq: Sequence, e: Exception) -> list[RequestOutput]:
        log.exception("post-processing request %s failed", seq.request_id)
        return self._fail(seq, f"post-processing failed: {type(e).__name__}: {e}")

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> RequestOutput:
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")
        ids = seq.token_ids
        ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprob)
        self.scheduler.waiting.charge_output(seq)
        self.scheduler.num_generated_tokens += 1
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)
        return seq.output()

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> list[RequestOutput]:
        """End `seq`; before its request forked, the choices still waiting on it end alike."""
        group = seq.group
        ended = group.seqs if group.needs_fork else [seq]
        for s in ended:
            s.finish_reason, s.error = reason, error
            if not s.finished:
                self.scheduler.finish(s)
        if group.finished and seq.request_id in self.seqs:
            self._ended(self.seqs[seq.request_id])
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
        if seq.grammar is not None and seq.grammar.is_terminated():
            # The constraint is complete (it ended on a stop token, even with ignore_eos), before
            # min_tokens too: its grammar allowed nothing else (vLLM's rule, vllm#54218).
            return "stop"
        return self._token_stop(seq, token)

    def _token_stop(self, seq: Sequence, token: int) -> str | None:
        """The finish reason that `seq`'s newest token decides, a grammar aside."""
        p = seq.params
        if p.min_tokens and seq.num_output_tokens < p.min_tokens:
            return None  # vLLM: no stop token ends a choice before min_tokens (the sampler masks them)
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None
