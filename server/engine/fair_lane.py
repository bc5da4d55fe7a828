"""A small thread pool that takes its jobs in turns across tenants: the grammar-mask lane's
(server.engine.mask_lane) in place of a FIFO executor.

With one FIFO, a tenant with fifty constrained requests queues fifty mask fills, and another
tenant's one fill waits behind all of them: its request sits out step after step while the
attacker's run. Here each tenant has a queue of its own and a free thread takes the next job from
the tenant after the one it served last (round robin over tenants with work waiting), so a
tenant's fill waits for at most one fill of each other tenant with work queued, plus the fills
already running when it came. A tenant alone still has every thread.

Threads start on first use, from the submitting thread (the engine's), and inherit its CPU
affinity; `initializer` runs first in each (the lane lowers their priority).
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Hashable


class FairLane:
    def __init__(self, threads: int, name: str, initializer: Callable[[], None] | None = None) -> None:
        assert threads >= 1
        self._threads = threads
        self._name = name
        self._initializer = initializer
        self._cond = threading.Condition()
        self._queues: dict[Hashable, deque[tuple[Future, Callable[[], None]]]] = {}
        self._turns: deque[Hashable] = deque()  # tenants with work waiting, next first
        self._started: list[threading.Thread] = []
        self._closed = False
        self.dispatched: list[Hashable] = []  # the tenant of each job, in the order threads took them

    def submit(self, tenant: Hashable, fn: Callable[[], None]) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the lane is shut down")
            queue = self._queues.setdefault(tenant, deque())
            if not queue:
                self._turns.append(tenant)
            queue.append((future, fn))
            if len(self._started) < self._threads:
                self._start_thread()
            self._cond.notify()
        return future

    def waiting(self, tenant: Hashable) -> int:
        with self._cond:
            return len(self._queues.get(tenant, ()))

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for future, _ in queue:
                    future.cancel()
            self._queues.clear()
            self._turns.clear()
            self._cond.notify_all()

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._started)}", daemon=True)
        self._started.append(thread)
        thread.start()

    def _next(self) -> tuple[Future, Callable[[], None]] | None:
        with self._cond:
            while not self._turns and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            job = queue.popleft()
            if queue:
                self._turns.append(tenant)  # its next job after every other tenant's
            else:
                del self._queues[tenant]
            self.dispatched.append(tenant)
            if len(self.dispatched) > 4096:
                del self.dispatched[:2048]
            return job

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (job := self._next()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - the submitter reads it from its future
                future.set_exception(e)
            else:
                future.set_result(None)
