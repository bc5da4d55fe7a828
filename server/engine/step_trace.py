"""A per-step trace for diagnosing step latency: with `LORAPLEX_STEP_TRACE=PATH` in the engine's environment,
every plain step appends one JSON line to PATH (StepRecord): when it started, how long its schedule, run and
post-processing took, the prompt budget it was given, and each row's tenant, first position, token count and
whether it decoded or carried a prompt chunk (with its prompt-logprob rows). Times are time.perf_counter(),
CLOCK_MONOTONIC on Linux, so a bench can line the steps up with its clients' own timestamps. Off (no file, no
per-step work beyond one None check) without the variable; a diagnostic, not a metric.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from server.engine.scheduler import ScheduledBatch, prompt_logprob_span

TRACE_ENV = "LORAPLEX_STEP_TRACE"


@dataclass(frozen=True)
class RowRecord:
    tenant: str | None
    start: int  # the row's first position (its computed tokens before the step)
    tokens: int  # tokens it computes this step
    prompt: bool  # a prompt chunk (False: a decoding row, drafts included)
    logprob_rows: int  # prompt positions whose logits give prompt logprobs this step


@dataclass(frozen=True)
class StepRecord:
    start: float  # perf_counter at schedule()
    schedule_s: float
    run_s: float
    postprocess_s: float
    prompt_budget: float | None  # the prompt work (StepCost units) the step was allowed; None: uncapped
    rows: tuple[RowRecord, ...]


def rows_of(batch: ScheduledBatch) -> tuple[RowRecord, ...]:
    """The batch's rows as scheduled (before the step moves their computed tokens on)."""
    rows = []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        start = seq.num_computed_tokens
        prompt = len(seq.token_ids) - start > 1  # as the scheduler tells them apart
        lo, hi = prompt_logprob_span(seq, start, n)
        rows.append(RowRecord(seq.tenant, start, n, prompt, max(0, hi - lo)))
    return tuple(rows)


class StepTrace:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (open for the engine's life)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def write(self, record: StepRecord) -> None:
        self.file.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.file.close()
