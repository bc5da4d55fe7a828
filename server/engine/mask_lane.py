"""Grammar masks filled ahead, off the engine step: a constrained choice's next token mask is filled
on a small pool of background threads, taken in turns across tenants (server.engine.fair_lane) as soon as its matcher has accepted a token (or at once, for
a new matcher), so the step never waits on one request's grammar.

xgrammar's `fill_next_token_bitmask` releases the GIL, so a fill runs beside the engine thread. The
pool's threads run at a lower priority than the engine's own (os.setpriority on the thread's native
id, Linux): on a busy CPU the forward wins. The scheduler runs a constrained choice's sampling step
only when its mask is `ready` (server.engine.scheduler); until then it sits out, keeping its KV
blocks and its seat, while everyone else's steps go on.

A matcher is never touched by two threads at once: a fill is in flight only between the step that
accepted a choice's tokens and its next sample, and the engine thread reads the matcher's termination
state once, before the fill starts.

With speculative decoding a fill also covers the drafts the choice will verify next (`refill`): on the
fill thread the matcher takes them one at a time, a mask row filled after each, and stops at the first
the grammar refuses (or one that completes it); then it rolls them back. The scheduler runs only the
drafts the grammar accepted (`drafts`), each verify position masked by its own row (`position`), so
every position samples as the plain engine would once the drafts before it are its output. The
tokens the step emits are then accepted for real (`accept_token`), and the next fill starts.

A draft model makes its drafts inside the step, after the next token's mask is ready: `check_drafts`
forks the matcher on the engine thread (a copy of its state; a fork that costs more than MAX_FORK_SECONDS
stops drafting for the choice) and the fork takes the drafts on the lane, rows 1.. filled as above, while
the step's forward runs. At sampling the step takes what the check has done (`settle_check`): the drafts
it accepted if it is done, none if not (the rows after the first then read no mask: nothing they choose
is emitted). The step never waits for it, and the real matcher is free for the step's tokens.

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
# A fork (check_drafts) runs on the engine thread: one above this CPU time ends drafting for its choice.
MAX_FORK_SECONDS = 0.005


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
                tenant: str | None = None, max_drafts: int = 0) -> LaneMatcher:
        """A new choice's matcher; `sibling`: another choice of its request, whose account it shares;
        `tenant`: whose turn its fills take on the lane; `max_drafts`: the most drafts a step verifies
        (speculative decoding's k; 0 without it)."""
        return LaneMatcher(self, xgr.GrammarMatcher(compiled), kind, sibling.spend if sibling else MaskSpend(), tenant,
                           max_drafts)

    def shutdown(self) -> None:
        self.pool.shutdown()


class LaneMatcher:
    """One constrained choice's matcher, with its next mask row filled ahead on the lane."""

    def __init__(self, lane: MaskLane, matcher: xgr.GrammarMatcher, kind: str, spend: MaskSpend,
                 tenant: str | None = None, max_drafts: int = 0) -> None:
        self.lane = lane
        self.tenant = tenant
        self.matcher = matcher
        self.kind = kind
        self.spend = spend  # its request's mask CPU time
        self.failure: str | None = None
        self._terminated = False
        # Row j: the mask of the position after j drafts (row 0 the next token's). [1 + max_drafts, W] int32
        self._rows = xgr.allocate_token_bitmask(1 + max_drafts, lane.vocab_size)
        self._proposed: list[int] = []  # the drafts the fill in flight checks
        self.drafts: list[int] = []  # of those, the ones the grammar accepts (read once the fill is done)
        self._stale = False  # tokens accepted since the last fill started: refill() starts the next
        self._started = 0.0
        self._future: Future = self._submit()
        # A draft model's drafts, checked in the step on a fork (check_drafts): the check in flight or last
        # run, the drafts it accepted, and that count as the step's sampling took it (None: no check).
        self._check: Future | None = None
        self._check_taken = 0
        self._settled: int | None = None
        self._forks_cheap = True

    # ---- the engine thread ----
    def accept_token(self, token: int) -> bool:
        """Advance by `token` (one the step emitted: its mask was ready); refill() starts the next fill."""
        assert self._future.done(), "a token accepted while its mask was still being filled"
        if not self.matcher.accept_token(token):
            return False
        self._terminated = self.matcher.is_terminated()
        self._stale = True
        self.drafts = []
        return True

    def refill(self, drafts: list[int] = ()) -> None:
        """Start filling the next masks, once the step's tokens are accepted: the next token's, and one per
        draft the grammar accepts of `drafts` (at most max_drafts: the next step's candidates)."""
        if self._stale and not self._terminated:
            self._stale = False
            self._proposed = list(drafts[: self._rows.shape[0] - 1])
            self._future = self._submit()

    def is_terminated(self) -> bool:
        return self._terminated

    @property
    def ready(self) -> bool:
        """Whether the next sample may run: its mask is filled, or the choice has failed its budget
        (the step then ends it). A fill running far past its cap fails the choice at once."""
        self.refill()  # tokens accepted that no refill followed (without drafts): fill now
        if self._future.done():
            return True
        rows = 1 + len(self._proposed)  # a fill with drafts fills a row after each the grammar accepts
        if time.perf_counter() - self._started > self.lane.budget.max_fill_seconds * IN_FLIGHT_SLACK * rows:
            self.failure = self.failure or self._over(self.lane.budget.max_fill_seconds, "one token's mask")
            return True
        return False

    @property
    def can_check(self) -> bool:
        """Whether a draft model's drafts may be checked now (check_drafts): the next mask is ready, the
        last check is done (its rows are not written under the next) and forks have stayed cheap."""
        return (self._forks_cheap and self.ready and self.failure is None and not self._terminated
                and (self._check is None or self._check.done()))

    def check_drafts(self, drafts: list[int]) -> None:
        """Start checking a draft model's drafts (at most max_drafts) on a fork of the matcher, filling row
        j after the j-th the grammar accepts, while the step runs; settle_check() takes the result."""
        assert self.can_check
        start = time.thread_time()
        fork = self.matcher.fork()
        seconds = time.thread_time() - start
        self.spend.add(seconds)
        self._forks_cheap = seconds <= MAX_FORK_SECONDS
        self._check_taken = 0
        self._settled = None
        proposed = list(drafts[: self._rows.shape[0] - 1])
        self._check = self.lane.pool.submit(self.tenant, lambda: self._check_fill(fork, proposed))

    def settle_check(self) -> int | None:
        """At the step's sampling: how many of the drafts check_drafts was given this step may be verified
        (those it accepted, or none while it still runs), fixed for the step; None when no check ran."""
        if self._check is None or self._settled is not None:
            return self._settled
        self._settled = self._check_taken if self._check.done() else 0
        return self._settled

    def row(self, j: int = 0) -> torch.Tensor:
        """[1, W] int32: the mask of the position after j of `drafts` (0: the next token's); every bit set
        once the choice has failed (its row's token is replaced by the failure), and past the drafts a check
        accepted (a row nothing emitted is chosen at, which its check may still be writing)."""
        row = self._rows[j : j + 1]
        if self.failure is not None or (j and self._settled is not None and j > self._settled):
            return torch.full_like(row, -1)
        return row

    def position(self, j: int) -> LaneMatcher | DraftPosition:
        """What a verify step's row j of this choice reads its mask from (j drafts before it)."""
        return self if j == 0 else DraftPosition(self, j)

    # ---- the fill thread ----
    def _submit(self) -> Future:
        self._started = time.perf_counter()
        return self.lane.pool.submit(self.tenant, self._fill)

    def _fill(self) -> None:
        """The next token's mask, then, over the drafts the grammar accepts in turn, each next position's;
        the matcher is left as it was (the drafts rolled back)."""
        try:
            first = self._fill_row(0)
        except Exception as e:  # noqa: BLE001 - this choice's failure, never the engine's
            self._broke(e)
            first = False
        stepped = taken = 0
        if first:
            stepped, taken = self._take(self.matcher, self._proposed)
            if stepped:
                self.matcher.rollback(stepped)
        self.drafts = self._proposed[:taken] if self.failure is None else []

    def _check_fill(self, fork: xgr.GrammarMatcher, proposed: list[int]) -> None:
        """check_drafts' fill: the fork takes the drafts as _fill's matcher does (nothing to roll back)."""
        _, taken = self._take(fork, proposed)
        self._check_taken = taken if self.failure is None else 0

    def _take(self, matcher: xgr.GrammarMatcher, proposed: list[int]) -> tuple[int, int]:
        """`matcher` takes the drafts in turn, row j filled after the j-th, up to the first the grammar
        refuses or one that completes it (nothing is verified past a draft that ends the choice): (the
        drafts it took, of those the ones with a filled row after them)."""
        stepped = taken = 0
        try:
            for token in proposed:
                if not matcher.accept_token(token, debug_print=False):
                    break
                stepped += 1
                if matcher.is_terminated() or not self._fill_row(stepped, matcher):
                    break
                taken = stepped
        except Exception as e:  # noqa: BLE001 - this choice's failure, never the engine's
            self._broke(e)
        return stepped, taken

    def _broke(self, e: Exception) -> None:
        self.failure = f"the {self.kind} constraint's token mask failed: {type(e).__name__}: {e}"

    def _fill_row(self, j: int, matcher: xgr.GrammarMatcher | None = None) -> bool:
        """Fill row j at the state of the matcher (or a fork of it), its CPU time charged; False when that
        fails the choice."""
        start = time.thread_time()
        (matcher or self.matcher).fill_next_token_bitmask(self._rows, j)
        seconds = time.thread_time() - start
        total = self.spend.add(seconds)
        budget = self.lane.budget
        if seconds > budget.max_fill_seconds:
            self.failure = self.failure or self._over(budget.max_fill_seconds, f"one token's mask ({seconds:.2f} s)")
        elif total > budget.max_total_seconds:
            self.failure = self.failure or self._over(budget.max_total_seconds, f"its masks together ({total:.2f} s)")
        return self.failure is None

    def _over(self, cap: float, what: str) -> str:
        return (f"the {self.kind} constraint is too costly to enforce: {what} took longer than the "
                f"{cap:g} s allowed; simplify it")


@dataclass(frozen=True)
class DraftPosition:
    """A verify step's row j > 0 of a constrained choice: its mask is the one filled after j drafts."""

    matcher: LaneMatcher
    j: int

    @property
    def failure(self) -> str | None:
        return self.matcher.failure

    def row(self) -> torch.Tensor:
        return self.matcher.row(self.j)
