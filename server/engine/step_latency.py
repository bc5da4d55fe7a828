"""The latency-aware prefill cap (`--max-prefill-tokens-while-decoding auto` on a CPU): how much prompt work
a step may carry while others decode, from what the engine's own steps cost (StepLatency).

As Sarathi-Serve picks its token budget from the time-between-tokens SLO: the engine keeps running
estimates of what a decode-only step takes and what one prompt decode-token equivalent (StepCost's unit)
adds to a step, from the wall time of the steps it runs (timed around work that already waits for its
tokens: no extra device syncs). Each is the median of its last WINDOW samples: on a shared CPU a step
preempted by another process takes several times its work, and a median ignores such steps where a
mean would follow them (so would one slow first prompt step, paying one-time allocations). While others decode, a step's prompt work is then bounded so that the step
costs at most `ratio` times a decode-only step, never more than the static cap and never less than
`floor` units, so a long prompt always progresses (and each tenant's first chunk still moves a token:
server.engine.scheduler._PrefillShares). Until both estimates exist (a fresh engine), the static cap holds.

A new adapter in a step (its copy into a device slot, and on a CPU, more than the copy: the step's first
LoRA rows for it) costs a step more than its prompt tokens say: on the demo model one new adapter's 11-token
prompt adds ~2.4 ms to a 1.2 ms decode step beyond what 11 base-model prompt tokens add. So a step that
loaded adapters teaches a third estimate instead of the unit's: what one load added beyond the decode step
and the prompt work at the unit's cost (until a unit is known, such a step teaches the unit as any other);
its median, in units (load_units), is what the scheduler charges each slot load against the same cap, so a
storm of new adapters' first requests is spread over steps as a long prompt is.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

# Samples each estimate is the median of: it follows the machine's load within ~16 steps.
WINDOW = 32


@dataclass(frozen=True)
class LatencyCap:
    ratio: float = 1.25  # a step with prompt work costs at most this times a decode-only step
    floor: float = 16.0  # decode-token equivalents of prompt work a step may always carry

    def __post_init__(self) -> None:
        assert self.ratio > 1 and self.floor > 0


@dataclass(frozen=True)
class StepTiming:
    """One step as the estimates see it: its wall time, its decoding rows and its prompt work (StepCost units)."""
    seconds: float
    decoding: int
    prompt_work: float
    slot_loads: int = 0  # adapters copied into device slots in the step


class StepLatency:
    def __init__(self, config: LatencyCap) -> None:
        self.config = config
        self.decode_samples: deque[float] = deque(maxlen=WINDOW)  # decode-only steps' seconds
        self.unit_samples: deque[float] = deque(maxlen=WINDOW)  # seconds one prompt unit added to a step
        self.load_samples: deque[float] = deque(maxlen=WINDOW)  # seconds one slot load added to a step
        self.decode_seconds: float | None = None
        self.unit_seconds: float | None = None
        self.load_seconds: float | None = None

    def observe(self, step: StepTiming) -> None:
        if step.prompt_work == 0:
            if step.decoding:
                self.decode_samples.append(step.seconds)
                self.decode_seconds = statistics.median(self.decode_samples)
            return
        if self.decode_seconds is None:
            return  # the step's fixed part is not known yet: its prompt work's share of the time is not either
        # A prompt-only step pays about the same fixed part (schedule, launch, sampling) as a decode-only one.
        extra = step.seconds - self.decode_seconds
        if step.slot_loads and self.unit_seconds is not None:
            loads = extra - step.prompt_work * self.unit_seconds
            self.load_samples.append(max(0.0, loads) / step.slot_loads)
            self.load_seconds = statistics.median(self.load_samples)
            return
        self.unit_samples.append(max(0.0, extra) / step.prompt_work)
        self.unit_seconds = statistics.median(self.unit_samples)

    def cap(self, ceiling: float) -> float:
        """Prompt work (StepCost units) a step may carry while others decode."""
        if self.decode_seconds is None or not self.unit_seconds:
            return ceiling
        room = (self.config.ratio - 1) * self.decode_seconds / self.unit_seconds
        return min(ceiling, max(self.config.floor, room))

    def load_units(self) -> float:
        """What one slot load adds to a step, in prompt units (0 until both are measured)."""
        if self.load_seconds is None or not self.unit_seconds:
            return 0.0
        return self.load_seconds / self.unit_seconds
