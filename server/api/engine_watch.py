"""The server's watch over its engine core: the last minutes of the engine's activity for the admin
console's charts (EngineHistory), and the server's exit once a separate core is gone for good
(exit_when_engine_dies).

EngineHistory: tokens and time-to-first-token are fed as they happen (`note_tokens`,
`note_ttft`); `sample()` turns the interval since the previous sample into one
point: generated tokens per second, median TTFT, and the queue, batch and KV
state at that moment. Bounded: a fixed number of points, a fixed TTFT window.

exit_when_engine_dies: with --engine-process separate, an engine core that is gone for good ends the
server.

The client notices a death within a poll interval (server.engine.protocol.remote) and fails every
open stream at once. With --engine-restart it starts a new core (/health 503 and requests 503 with
Retry-After meanwhile) and this watch keeps waiting; once the core is not restarted (the flag off, or
its crash-loop limit reached) the server still answers for ENGINE_DEATH_EXIT_DELAY_S more (the ended
streams' SSE error events flushed), then stops with exit status 1 for its orchestrator to restart it.
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

from server.engine.protocol import EngineClient, EngineStats

log = logging.getLogger(__name__)

SAMPLE_SECONDS = 2.0
POINTS = 150  # five minutes at one point per two seconds


class EngineHistory:
    def __init__(self, points: int = POINTS) -> None:
        self.points: deque[dict] = deque(maxlen=points)
        self._tokens = 0
        self._ttfts: deque[float] = deque(maxlen=4096)
        self._last_at = time.monotonic()
        self._last_tokens = 0

    def note_tokens(self, n: int) -> None:
        self._tokens += n

    def note_ttft(self, seconds: float) -> None:
        self._ttfts.append(seconds)

    def sample(self, stats: EngineStats, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        elapsed = max(1e-6, now - self._last_at)
        ttfts = list(self._ttfts)
        self._ttfts.clear()
        point = {"t": time.time(), "tokens_per_s": (self._tokens - self._last_tokens) / elapsed,
                 "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                 "running": stats.scheduler.running, "waiting": stats.scheduler.waiting,
                 "kv_blocks_used": stats.kv_blocks.used, "kv_blocks_total": stats.kv_blocks.total}
        self._last_at, self._last_tokens = now, self._tokens
        self.points.append(point)
        return point

    async def run(self, stats) -> None:
        """Sample every SAMPLE_SECONDS; `stats()` gives the engine's latest snapshot (cancel to stop)."""
        while True:
            await asyncio.sleep(SAMPLE_SECONDS)
            self.sample(stats())


ENGINE_DEATH_EXIT_DELAY_S = 1.0
_POLL_S = 0.1


async def exit_when_engine_dies(engine: EngineClient, exit_server: Callable[[], None]) -> None:
    while engine.is_healthy or engine.is_restarting:
        await asyncio.sleep(_POLL_S)
    log.error("the engine core is gone (%s): the server exits with status 1 in %g s", engine.error,
              ENGINE_DEATH_EXIT_DELAY_S)
    await asyncio.sleep(ENGINE_DEATH_EXIT_DELAY_S)
    exit_server()
