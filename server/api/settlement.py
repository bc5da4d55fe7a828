"""Settling a finished request in Redis (concurrency lease, token charge, usage), with retries.

A request that ends while Redis is unreachable must not leak its lease until
it expires, nor lose its usage: the settlement is queued and retried in the
background until Redis answers again. Retries are bounded in count and age,
so a long outage cannot grow the queue without limit (a lease left behind
then expires on its own after the limiter's lease time).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

import redis
from starlette.concurrency import run_in_threadpool

from tenants import Admission, Limiter, Tenant, UsageLog

log = logging.getLogger(__name__)

MAX_PENDING = 100_000
MAX_AGE_SECONDS = 3600.0
RETRY_INTERVAL_SECONDS = 0.5


@dataclass(frozen=True)
class Settlement:
    tenant: Tenant
    admission: Admission
    prompt_tokens: int
    completion_tokens: int
    adapter: str | None    # the adapter's name, None for the base model
    created: float


class Settlements:
    def __init__(self, limiter: Limiter, usage: UsageLog) -> None:
        self._limiter = limiter
        self._usage = usage
        self._pending: deque[tuple[Settlement, bool]] = deque()  # (what, lease already released)
        self.dropped = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def settle(self, tenant: Tenant, admission: Admission, prompt_tokens: int, completion_tokens: int,
               adapter: str | None = None) -> None:
        """Blocking; never raises for a Redis fault (the settlement is queued instead)."""
        item = Settlement(tenant, admission, prompt_tokens, completion_tokens, adapter, time.monotonic())
        done = self._try(item, released=False)
        if done is not True:
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
                log.error("settlement queue full; dropping usage of request %s", admission.request_id)
                return
            self._pending.append((item, done == "released"))

    def _try(self, item: Settlement, released: bool) -> bool | str:
        """True when fully settled, "released" when only the lease went back, False when nothing did."""
        try:
            if not released:
                self._limiter.release(item.admission, item.prompt_tokens + item.completion_tokens)
                released = True
            self._usage.record(item.tenant, item.prompt_tokens, item.completion_tokens, adapter=item.adapter)
            return True
        except redis.RedisError as e:
            log.warning("settling request %s failed (%r); will retry", item.admission.request_id, e)
            return "released" if released else False

    def retry_pending(self) -> None:
        """One pass over the queue, oldest first; stops at the first item Redis still refuses."""
        now = time.monotonic()
        while self._pending:
            item, released = self._pending[0]
            if now - item.created > MAX_AGE_SECONDS:
                self._pending.popleft()
                self.dropped += 1
                continue
            done = self._try(item, released)
            if done is not True:
                self._pending[0] = (item, done == "released")
                return
            self._pending.popleft()

    async def run(self) -> None:
        """The background retry loop (cancel it to stop)."""
        while True:
            await asyncio.sleep(RETRY_INTERVAL_SECONDS)
            if self._pending:
                await run_in_threadpool(self.retry_pending)
