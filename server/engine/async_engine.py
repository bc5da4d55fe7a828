"""AsyncEngine: the LLMEngine's step loop on its own thread, fed from asyncio.

LLMEngine is not thread-safe, so exactly one thread (the loop thread) ever
touches it. Event-loop code talks to that thread through a command queue:
adds, aborts and adapter calls are drained before each step, and every
step's outputs go back to each request's asyncio.Queue with
`loop.call_soon_threadsafe`. The event loop never waits for a step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from server.engine.cpu_affinity import pin_thread
from server.engine.engine_stats import EngineStats
from server.engine.llm_engine import LLMEngine
from server.engine.protocol.errors import EngineDeadError
from server.engine.protocol.request import EngineRequest
from server.engine.request_stream import RequestStream, Sink, dispatch
from server.engine.sequence import RequestOutput

if TYPE_CHECKING:
    from adapters.format import LoraAdapter

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # read-only attributes (tokenizer, max_model_len, ...) are safe to share
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._sinks: dict[str, Sink] = {}  # touched by the loop thread only
        self._stats_lock = threading.Lock()
        self._stats = engine.stats()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ---- lifecycle ----
    def start(self) -> None:
        assert self._thread is None, "AsyncEngine.start() called twice"
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def error(self) -> str | None:
        """Why the step loop died (the exception's repr), for /health; None while it runs or after a clean
        shutdown. Only a bug in the engine itself ends the loop: a request's failure ends that request."""
        return None if self._error is None else repr(self._error)

    # ---- requests ----
    async def submit(self, request: EngineRequest) -> RequestStream:
        """Add the request; raises RequestError (too long, unknown adapter...) before any output.
        Its `grammar` is compiled already (LLMEngine.add_request), so the loop never compiles."""
        loop = asyncio.get_running_loop()
        n = request.params.n
        sink = Sink(loop, n)
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", request, sink, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request.request_id)  # it may have been added just before we gave up
            raise
        return RequestStream(self, request.request_id, sink, n)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        stream = await self.submit(request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Thread-safe; a no-op for a request that already finished."""
        self._send(("abort", request_id))

    # ---- adapters and stats (run on the loop thread) ----
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.call_soon(fn))

    def call_soon(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run fn on the loop thread; its result (or exception) in the future. From any thread."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, done))
        return done

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run fn on the loop thread without waiting; ordered with every other command."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.add_done_callback(
            lambda f: f.exception() and log.error("engine call failed", exc_info=f.exception()))
        self._send(("call", fn, done))

    async def add_adapter(self, version_id: str, adapter: LoraAdapter) -> None:
        await self.call(lambda e: e.add_adapter(version_id, adapter))

    async def remove_adapter(self, version_id: str) -> None:
        await self.call(lambda e: e.remove_adapter(version_id))

    def remove_adapter_nowait(self, version_id: str) -> None:
        self.post(lambda e: e.remove_adapter(version_id))

    async def has_adapter(self, version_id: str) -> bool:
        return await self.call(lambda e: e.has_adapter(version_id))

    def stats(self) -> EngineStats:
        """The counters as of the last step or command (a consistent snapshot)."""
        with self._stats_lock:
            return self._stats

    # ---- the loop thread ----
    def _send(self, command: tuple) -> None:
        if self._error is not None or self._stopping.is_set():
            raise EngineDeadError(f"the engine is not running ({self._error or 'shut down'})")
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        engine = self.engine
        try:
            engine.bind_thread()  # this thread's kernels and streams go to the engine's CUDA device
            pin_thread(engine.config.cpu_affinity)  # the step loop (and threads it starts) on the engine's cores
            while not self._stopping.is_set():
                # Cleared before draining: a command sent after the drain sets it again,
                # so the wait below cannot sleep through it.
                self._wakeup.clear()
                self._drain()
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    # Stats first: a caller woken by an output must find a snapshot at least as new.
                    self._publish_stats()
                    dispatch(self._sinks, outputs)
                else:
                    self._publish_stats()
                    self._wakeup.wait()
        except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
            log.exception("engine step loop crashed")
            self._error = e
        finally:
            self._fail_all(self._error or EngineDeadError("the engine was shut down"))

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                _, r, sink, accepted = cmd
                try:
                    self.engine.add_request(r.request_id, r.prompt_ids, r.params, r.version_id, r.tenant,
                                            r.priority, r.tenant_weight, cache_salt=r.cache_salt,
                                            grammar=r.grammar)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    accepted.set_exception(e)
                    continue
                self._sinks[r.request_id] = sink
                accepted.set_result(None)
            elif kind == "abort":
                self.engine.abort_request(cmd[1])
            elif kind == "call":
                _, fn, done = cmd
                try:
                    done.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    done.set_exception(e)
            else:
                raise AssertionError(f"unknown command {kind!r}")

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        with self._stats_lock:
            self._stats = stats

    def _fail_all(self, error: BaseException) -> None:
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(f"engine crashed: {error!r}")
        for sink in self._sinks.values():
            sink.put(dead)
        self._sinks.clear()
        while True:  # commands that arrived after the end: answer them too
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            for item in cmd:
                if isinstance(item, concurrent.futures.Future) and not item.done():
                    item.set_exception(dead)

