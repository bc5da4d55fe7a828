"""CoreSilence: how long an engine core has sent this front end nothing, counting only the time this
front end's receiver thread itself ran on schedule.

The core pushes stats every STATS_INTERVAL_S from a thread of its own, so a long silence means its
output thread is stuck or gone, and the front end kills it as hung. But the receiver measures that
silence between its own polls, and a receiver that did not run (its process's GIL held by another
thread for seconds, or the whole machine paused: a loaded CI box, a VM's stolen time) would wake to a
gap the core never made: the core's pushes sat queued, or the core was paused with it. Killing a core
for that fails every request in flight. So a gap between two of the receiver's polls that is longer
than `slack_s` does not count: only silence the receiver saw while it ran counts toward the timeout,
and a hung core is still found within timeout_s of the front end's running time.
"""
from __future__ import annotations

import time
from collections.abc import Callable


class CoreSilence:
    def __init__(self, timeout_s: float, slack_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._slack_s = slack_s  # a poll interval longer than this: the receiver itself was held up
        self._clock = clock
        self._silent_s = 0.0
        self._last = clock()

    def heard(self) -> None:
        """The core sent something (or a new core was connected): the silence starts again."""
        self._silent_s = 0.0
        self._last = self._clock()

    def quiet(self) -> bool:
        """After a poll that found nothing: whether the core has now been silent for timeout_s."""
        now = self._clock()
        elapsed, self._last = now - self._last, now
        if elapsed <= self._slack_s:
            self._silent_s += elapsed
        return self._silent_s > self.timeout_s

    @property
    def silent_s(self) -> float:
        return self._silent_s
