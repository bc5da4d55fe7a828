"""Wall time of an engine step's phases (schedule, prepare, forward, sample, postprocess), for the
step benchmarks (benchmarks/engine/bench_engine.py, benchmarks/profile/profile_step.py). Installed on one engine
instance (and the runner module's sampler) and removed again; the engine is not changed."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import server.engine.model_runner as model_runner

PHASES = ("schedule", "prepare", "forward", "sample", "postprocess")


class Timer:
    """Wraps a callable and accumulates its wall time."""

    def __init__(self, fn, clock=time.perf_counter):
        self.fn = fn
        self.clock = clock
        self.total = 0.0
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        t = self.clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += self.clock() - t


@contextmanager
def timed_phases(engine, clock=time.perf_counter) -> Iterator[dict[str, Timer]]:
    """Yields phase -> Timer while each phase of `engine.step()` runs through its timer (timed by `clock`:
    wall time, or time.thread_time for the step thread's CPU time)."""
    # Each phase is the method of that name on its owner; sampling is the runner module's function.
    owners = {"schedule": engine.scheduler, "prepare": engine.runner, "forward": engine.runner.model,
              "postprocess": engine.output_processor}
    timers = {phase: Timer(getattr(owner, phase), clock) for phase, owner in owners.items()}
    timers["sample"] = Timer(model_runner.sample_rows, clock)
    for phase, owner in owners.items():
        setattr(owner, phase, timers[phase])  # shadows the method on this instance only
    model_runner.sample_rows = timers["sample"]
    try:
        yield {phase: timers[phase] for phase in PHASES}
    finally:
        model_runner.sample_rows = timers["sample"].fn
        for phase, owner in owners.items():
            delattr(owner, phase)
