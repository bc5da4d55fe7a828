"""Async scheduling (vLLM's `--async-scheduling`): the host schedules and prepares step N+1 while step N
runs, and post-processes step N while step N+1 runs.

A step's forward and sampling run on one worker thread, in launch order; the
engine thread meanwhile does the host's share of the next step. On a CPU,
torch releases the GIL inside its ops, so the host work runs on a core the
forward does not use (`--cpu-threads auto` leaves one on small machines); on
a GPU the worker's launches are asynchronous anyway, and the one wait per
step is the sampler's read of its tokens.

While step N runs, step N+1 is scheduled ahead of N's tokens (`launch_ahead`):
the same decoding sequences, each one token further on, in the same order,
its input id being N's sampled token, filled in on the worker once sampled
(ModelRunner.fill_ahead). That is the synchronous scheduler's batch except
for the sequences that N ends, which nobody knows before N's tokens are in:
a sequence N ends by EOS, a stop token or a stop string keeps its row in
N+1, whose token is discarded (never appended, streamed or charged); one that
N ends by length is left out. A sequence aborted meanwhile is skipped alike.

Overlapped, then, are decode-only steps whose every row is a plain decode
row: one token, no logits processor that reads the sequence's own tokens
(penalties), no min_tokens (its masked stop ids change with the count), no
structured-output grammar (its matcher must accept N's token before N+1's
mask exists), no pending n > 1 fork (the choices join the batch after it), no
prompt logprobs to make. Every other step runs synchronously, as it would
without the option: prefill and mixed steps, steps with a copy-on-write or
a preemption, and a step after which the synchronous schedule could differ
from "the same rows, one token on": requests waiting to be admitted (an
admission may load an adapter into a slot, evict one, or preempt), running
sequences the step in flight does not cover, or too few free blocks for the
next token (the synchronous scheduler would preempt). Steps that do not
overlap cost nothing extra: the step in flight is collected first.

Greedy tokens are those of the synchronous engine: each step's rows are the
synchronous schedule's (plus discarded rows), and a row's logits depend on
its own sequence alone, up to the float rounding a batch's size may move. The engine's unseeded random stream is shared by
every sampled row, so a discarded row shifts later draws: sampled (not
greedy) output is valid but not draw-for-draw the synchronous engine's.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from server.engine.block_manager import BlockManager
from server.engine.model_runner import ModelRunner, SeqResult, StepInputs
from server.engine.scheduler import ScheduledBatch, Scheduler
from server.engine.sequence import Sequence, SequenceStatus


def overlappable_row(seq: Sequence, num_tokens: int) -> bool:
    """A plain decode row: its next step needs nothing from its sampled token but the token id."""
    p = seq.params
    return (num_tokens == 1 and seq.num_pending_tokens == 1 and seq.num_output_tokens > 0 and p.max_tokens > 0
            and not p.has_row_state and seq.grammar is None and not seq.group.needs_fork)


def overlappable(batch: ScheduledBatch) -> bool:
    """A decode-only step of plain rows, with no block copy to make first and no preemption."""
    return (not batch.empty and not batch.block_copies and not batch.preempted
            and all(map(overlappable_row, batch.seqs, batch.num_tokens)))


@dataclass(frozen=True)
class AsyncStats:
    """All 0 without --async-scheduling."""

    launched: int = 0  # steps run on the worker
    ahead: int = 0  # of those, scheduled while the step before them ran
    discarded: int = 0  # rows of those whose request had ended (or was aborted) before their token came
    host_overlapped_seconds: float = 0.0  # engine-thread time spent while a step ran on the worker


@dataclass
class _Launched:
    batch: ScheduledBatch
    future: Future  # of dict[int, SeqResult]


class AsyncScheduling:
    """The worker thread and the steps launched on it (at most two: the one running, the one queued
    behind it); the engine calls `launch`, `launch_ahead` and `collect` from its step()."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, blocks: BlockManager, max_model_len: int,
                 init_thread: Callable[[], None]) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.blocks = blocks
        self.max_model_len = max_model_len
        threads = torch.get_num_threads()

        def init_worker() -> None:
            init_thread()  # the engine's CUDA device (server.engine.cuda_device)
            torch.set_num_threads(threads)

        self.worker = ThreadPoolExecutor(1, thread_name_prefix="loraplex-step", initializer=init_worker)
        self.launched: deque[_Launched] = deque()
        self.num_launched = 0
        self.num_ahead = 0
        self.num_discarded = 0
        self.host_overlapped_seconds = 0.0
        self._since: float | None = None  # when the engine thread last found a step running

    @property
    def in_flight(self) -> bool:
        return bool(self.launched)

    def stats(self) -> AsyncStats:
        return AsyncStats(self.num_launched, self.num_ahead, self.num_discarded, self.host_overlapped_seconds)

    def launch(self, batch: ScheduledBatch) -> bool:
        """Start `batch` on the worker if it can overlap (its results come from `collect`); False: run
        it synchronously."""
        assert not self.launched, "a new schedule while a step is in flight"
        if not overlappable(batch):
            return False
        inputs = self.runner.prepare(batch)
        assert inputs.prompt is None and not inputs.scored_seqs
        self._submit(batch, self.worker.submit(self.runner.execute, inputs))
        return True

    def launch_ahead(self) -> None:
        """Schedule and prepare the step after the one in flight, before its tokens are known, and queue
        it behind it; nothing when the synchronous schedule could differ (see the module's docstring)."""
        assert len(self.launched) == 1
        last = self.launched[-1]
        scheduled = self._schedule_ahead(last.batch)
        if scheduled is None:
            return
        batch, source = scheduled
        inputs = self.runner.prepare(batch, ahead=True)
        self.num_ahead += 1
        self._submit(batch, self.worker.submit(self._run_ahead, batch, inputs, last.future, source))

    def collect(self) -> tuple[ScheduledBatch, dict[int, SeqResult]]:
        """The oldest launched step and its results, once sampled (the engine post-processes them)."""
        launched = self.launched.popleft()
        self._note_host_time()
        results = launched.future.result()
        self._since = time.perf_counter() if self.launched else None
        self.num_discarded += sum(seq.finished for seq in launched.batch.seqs)  # postprocess skips them
        return launched.batch, results

    def shutdown(self) -> None:
        self.worker.shutdown(wait=True)

    # ---- internals ----
    def _submit(self, batch: ScheduledBatch, future: Future) -> None:
        self.num_launched += 1
        if self._since is None:
            self._since = time.perf_counter()
        self.launched.append(_Launched(batch, future))

    def _note_host_time(self) -> None:
        """Engine-thread time since the worker last had a step, up to now (the host work it overlapped,
        bounded by the worker's own busy time only in that the engine waits for it next)."""
        if self._since is not None:
            self.host_overlapped_seconds += time.perf_counter() - self._since

    def _run_ahead(self, batch: ScheduledBatch, inputs: StepInputs, previous: Future,
                   source: list[int]) -> dict[int, SeqResult]:
        """On the worker, after `previous`: its sampled tokens become this step's input ids. Skipped when
        `previous` ended every row's request (read across threads: a stale answer runs a step whose
        rows are all discarded anyway)."""
        results = previous.result()  # done: the worker runs steps in order
        if all(seq.finished for seq in batch.seqs):
            return {}
        tokens = [_token(results.get(i)) for i in source]
        return self.runner.execute(self.runner.fill_ahead(inputs, tokens))

    def _schedule_ahead(self, running_batch: ScheduledBatch) -> tuple[ScheduledBatch, list[int]] | None:
        """The synchronous scheduler's next batch, less what only the running step's tokens can tell, and
        each row's position in `running_batch`; None where it could be anything else."""
        scheduler = self.scheduler
        if scheduler.waiting:
            return None  # an admission: the synchronous scheduler decides, after this step
        in_batch = set(running_batch.seqs)
        if any(seq not in in_batch for seq in scheduler.running):
            return None  # a sequence this step does not advance (a fork's choices, a budget cut)
        batch, source, need = ScheduledBatch(), [], 0
        size = self.blocks.block_size
        for i, seq in enumerate(running_batch.seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            length = len(seq.token_ids) + 1  # with the running step's token
            if length - seq.num_prompt_tokens >= seq.params.max_tokens or length >= self.max_model_len:
                continue  # the running step ends it by length
            position = seq.num_computed_tokens + 1  # of the running step's token, this step's input
            scheduler.release_behind_window(seq)  # behind the running step's query, so this one's too
            if position // size < len(seq.block_table) and scheduler.kv.shared_written(seq, position + 1):
                return None  # a copy-on-write first: the synchronous scheduler makes it
            need += scheduler.kv.blocks_needed(seq, position + 1)
            batch.seqs.append(seq)
            batch.num_tokens.append(1)
            batch.lora_slots.append(scheduler.lora_slot_of_seq.get(seq, -1))
            source.append(i)
        if batch.empty or need > self.blocks.num_free_blocks:
            return None  # nothing to run, or the synchronous scheduler would preempt
        for seq in batch.seqs:
            scheduler.kv.grow(seq, seq.num_computed_tokens + 2)
        return batch, source


def _token(result: SeqResult | None) -> int:
    """The token a row of the running step sampled; 0 for a row whose request fails (its next row is
    discarded with it)."""
    token = result.tokens[0] if result is not None and result.tokens else 0
    return token if isinstance(token, int) else 0
