"""/health's view of Redis, answered within a second whatever Redis does: a PING on a connection of
its own with a short timeout, on a thread of its own, one at a time. A frozen Redis (SIGSTOP, a
stalled network) would otherwise hold /health as long as the request path's 5 s timeout, and every
probe would take one more of the request path's pooled connections and threadpool threads."""
from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

import redis

PROBE_TIMEOUT_SECONDS = 0.5


class RedisProbe:
    def __init__(self, url: str, timeout: float = PROBE_TIMEOUT_SECONDS) -> None:
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="redis-probe")
        self._pending: Future[str | None] | None = None
        self._timeout = timeout

    async def problem(self) -> str | None:
        """What is wrong with Redis (None: it answered a PING). Probes still running are joined,
        not stacked: a frozen Redis holds one thread, however often /health is asked."""
        if self._pending is None or self._pending.done():
            self._pending = self._executor.submit(self._ping)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._pending)), self._timeout * 1.5)
        except asyncio.TimeoutError:
            return f"Redis did not answer a PING within {self._timeout * 1.5:.2f} s"

    def _ping(self) -> str | None:
        try:
            return None if self._client.ping() else "Redis answered a PING with an error"
        except (redis.RedisError, OSError) as e:
            return f"Redis did not answer a PING ({type(e).__name__})"

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._client.close()
