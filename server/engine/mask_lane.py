"""Grammar masks filled ahead, off the engine step: a constrained choice's next token mask is filled
on a small pool of background threads, taken in turns across tenants (server.engine.fair_lane) as soon as its matcher has accepted a token (or at once, for
a new matcher), so the step never waits on one request's grammar.

xgrammar's `fill_next_token_bitmask` releases the GIL, so a fill runs beside the engine thread. The
pool's threads run at a lower priority than the engine's own (os.setpriority on the thread's native
id, Linux): on a busy CPU the forward wins. The scheduler runs a constrained choice's sampling step
only when its mask is `ready` (server.engine.scheduler); until then it sits out, keeping its KV
blocks and its seat, while everyone else's steps go on.

A matcher is never touched by two threads at once: a fill is in flight only between an accepted
token and the next sample of that choice, and the engine thread reads the matcher's termination
state once, before the fill starts.

Each fill's CPU time is charged to its request (its n choices share one account): one fill past
`max_fill_seconds`, or the request's fills together past `max_total_seconds`, fail the choice
(`failure`), and its next step ends the request with an error naming the constraint, a client error
(400), since the constraint is what costs.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import xgrammar as xgr

from server.engine.fair_lane import FairLane

# Background nice value of the fill threads: below the engine's own threads on a shared CPU.
FILL_NICENESS = 10
# An in-flight fill's wall time counts as over budget past this many times the per-fill cap (its
# CPU time is only known at its end; wall time on a busy machine runs ahead of CPU time).
IN_FLIGHT_SLACK = 4.0


class MaskSpend:
    """One request's mask CPU time so far, charged from the fill threads of each of its choices."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0

    def add(self, seconds: float) -> float:
        """The total with `seconds` charged."""
        with self._lock:
            self.seconds += seconds
            return self.seconds


@dataclass(frozen=True)
class MaskBudget:
    """Caps on one constrained choice's mask work (EngineConfig's max_mask_fill_seconds and
    max_mask_seconds_per_request)."""

    max_fill_seconds: float = 1.0
    max_total_seconds: float = 60.0

    def __post_init__(self) -> None:
        assert self.max_fill_seconds > 0 and self.max_total_seconds > 0


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FILL_NICENESS)
    except (AttributeError, OSError):
        pass  # not Linux: per-thread priorities are out of reach; the fills still run off the step


class MaskLane:
    """The fill pool, shared by every constrained choice of one engine."""

    def __init__(self, vocab_size: int, budget: MaskBudget, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.budget = budget
        workers = threads or max(1, min(4, os.cpu_count() or 1))
        # Fills are taken in turns across tenants (server.engine.fair_lane), not first come first served.
        self.pool = FairLane(workers, "loraplex-mask", initializer=_lower_priority)

    def matcher(self, compiled: xgr.CompiledGrammar, kind: str, sibling: LaneMatcher | None = None,
                tenant: str | None = None) -> LaneMatcher:
        """A new choice's matcher; `sibling`: another choice of its request, whose account it shares;
        `tenant`: whose turn its fills take on the lane."""
        return LaneMatcher(self, xgr.GrammarMatcher(compiled), kind, sibling.spend if sibling else MaskSpend(), tenant)

    def shutdown(self) -> None:
        self.pool.shutdown()


class LaneMatcher:
    """One constrained choice's matcher, with its next mask row filled ahead on the lane."""

    def __init__(self, lane: MaskLane, matcher: xgr.GrammarMatcher, kind: str, spend: MaskSpend,
                 tenant: str | None = None) -> None:
        self.lane = lane
        self.tenant = tenant
        self.matcher = matcher
        self.kind = kind
        self.spend = spend  # its request's mask CPU time
        self.failure: str | None = None
        self._terminated = False
        self._row = xgr.allocate_token_bitmask(1, lane.vocab_size)  # [1, W] int32
        self._started = 0.0
        self._future: Future = self._submit()

    # ---- the engine thread ----
    def accept_token(self, token: int) -> bool:
        """Advance by `token` (the sampled one: its mask was ready) and start the next fill."""
        assert self._future.done(), "a token accepted while its mask was still being filled"
        if not self.matcher.accept_token(token):
            return False
        self._terminated = self.matcher.is_terminated()
        if not self._terminated:
            self._future = self._submit()
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    @property
    def ready(self) -> bool:
        """Whether the next sample may run: its mask is filled, or the choice has failed its budget
        (the step then ends it). A fill running far past its cap fails the choice at once."""
        if self._future.done():
            return True
        if time.perf_counter() - self._started > self.lane.budget.max_fill_seconds * IN_FLIGHT_SLACK:
            self.failure = self.failure or self._over(self.lane.budget.max_fill_seconds, "one token's mask")
            return True
        return False

    def row(self) -> torch.Tensor:
        """[1, W] int32: the next token's mask (every bit set once the choice has failed: its row's token is
        replaced by the failure)."""
        return torch.full_like(self._row, -1) if self.failure is not None else self._row

    # ---- the fill thread ----
    def _submit(self) -> Future:
        self._started = time.perf_counter()
        return self.lane.pool.submit(self.tenant, self._fill)

    def _fill(self) -> None:
        start = time.thread_time()
        try:
            self.matcher.fill_next_token_bitmask(self._row)
        except Exception as e:  # noqa: BLE001 - this choice's failure, never the engine's
            self.failure = f"the {self.kind} constraint's token mask failed: {type(e).__name__}: {e}"
            return
        seconds = time.thread_time() - start
        total = self.spend.add(seconds)
        budget = self.lane.budget
        if seconds > budget.max_fill_seconds:
            self.failure = self.failure or self._over(budget.max_fill_seconds, f"one token's mask ({seconds:.2f} s)")
        elif total > budget.max_total_seconds:
            self.failure = self.failure or self._over(budget.max_total_seconds, f"its masks together ({total:.2f} s)")

    def _over(self, cap: float, what: str) -> str:
        return (f"the {self.kind} constraint is too costly to enforce: {what} took longer than the "
                f"{cap:g} s allowed; simplify it")
