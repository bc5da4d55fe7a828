"""The engine as asyncio sees it: the LLMEngine's step loop on its own thread, fed from asyncio
(AsyncEngine), each accepted request's outputs as the front end iterates them (RequestStream), and the
EngineClient over that loop in this process (InProcessEngineClient).

LLMEngine is not thread-safe, so exactly one thread (the loop thread) ever
touches it. Event-loop code talks to that thread through a command queue:
adds, aborts and adapter calls are drained before each step, and every
step's outputs go back to each request's asyncio.Queue with
`loop.call_soon_threadsafe`. The event loop never waits for a step.

RequestStream: one accepted request's outputs as the front end iterates them, fed through a Sink
(one slot per choice on the caller's event loop) by whichever side runs the engine: the step loop's
thread in this process (AsyncEngine) or the engine-core client's output thread
(server.engine.protocol.remote).

Backpressure: outputs are cumulative, so a Sink keeps only each choice's newest undelivered output,
never a backlog. A consumer that stops reading (an SSE client that stopped reading its socket blocks
its route's writes, and with them its reads here) holds at most one output per choice and the
engine's error: it can neither grow the front end's memory nor slow the engine or other streams; the
request runs on to its end (or its max_tokens) and whatever the client reads later carries every
token up to then in one chunk.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from server.engine.adapter_residency import adapter_tiers, held_versions, residency, take_load_times
from server.engine.choice_abort import ChoiceAbort
from server.engine.config import EngineConfig
from server.engine.core.commands import nap
from server.engine.cpu_affinity import pin_thread
from server.engine.engine_stats import EngineStats
from server.engine.grammar_worker import GrammarCompileService
from server.engine.llm_engine import LLMEngine
from server.engine.output_text import RequestText
from server.engine.protocol.client import EngineClient
from server.engine.protocol.errors import EngineDeadError
from server.engine.protocol.info import engine_info
from server.engine.protocol.request import EngineRequest
from server.engine.protocol.residency import AdapterTiers, LoadTimes
from server.engine.protocol.snapshot import EngineSnapshot, engine_snapshot
from server.engine.sequence import RequestOutput

if TYPE_CHECKING:
    from adapters.format import LoraAdapter
    from adapters.host_tier import Fetch
    from server.engine.lora.dora_scale_cache import ScaleStore

log = logging.getLogger(__name__)


class Aborts(Protocol):
    def abort(self, request_id: str) -> None: ...


@dataclass
class Sink:
    """Where one request's outputs go, on the caller's event loop: its choices' newest undelivered
    outputs (in the order their choices first arrived) and the error that ended it, if any."""

    loop: asyncio.AbstractEventLoop
    unfinished: int = 1  # choices still running in the engine: the sink goes when the last one finishes
    # The outputs' text, made on the caller's loop as they arrive (not as they are read, so a stop string
    # ends the request in the engine however slowly its consumer reads); None leaves them as they are.
    text: RequestText | None = None
    pending: dict[int, RequestOutput] = field(default_factory=dict)
    error: BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def offer(self, item: RequestOutput | BaseException) -> None:
        """On the loop's thread. A choice's newer output replaces its older one, keeping its place."""
        if isinstance(item, BaseException):
            self.error = item
        elif self.error is None:
            if self.text is not None:
                item = self.text.apply(item)
                if item is None:
                    return  # its choice ended here already (a stop string): the engine's abort output
            self.pending[item.index] = item
        self.ready.set()

    def put(self, item: RequestOutput | BaseException) -> None:
        """From any thread."""
        try:
            self.loop.call_soon_threadsafe(self.offer, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more

    async def take(self) -> list[RequestOutput]:
        """Every pending output, oldest choice first; the error once none is pending."""
        while not self.pending and self.error is None:
            self.ready.clear()
            await self.ready.wait()
        if not self.pending:
            raise self.error
        taken, self.pending = list(self.pending.values()), {}
        return taken


class RequestStream:
    """An accepted request's outputs: per choice (`index`), cumulative, the last one `finished`.

    Iterate it; it ends once every one of the request's n choices has given
    its finished output. Closing it (or cancelling the iterating task) before
    the end aborts the request in the engine, which frees its KV blocks.
    Outputs are cumulative, so a consumer that fell behind gets only the
    newest one of each choice: one chunk carrying several tokens instead of a
    backlog of one-token chunks (the Sink never holds more).
    """

    def __init__(self, engine: "Aborts", request_id: str, sink: Sink, n: int = 1) -> None:
        self.request_id = request_id
        self._engine = engine
        self._sink = sink
        self._unfinished = n
        self._pending: list[RequestOutput] = []
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pending:
            if self._done:
                raise StopAsyncIteration
            try:
                self._pending = await self._sink.take()
            except asyncio.CancelledError:
                self.abort()  # cancelled while waiting: the consumer is gone
                raise
            except BaseException:
                self._done = True
                raise
            self._unfinished -= sum(out.finished for out in self._pending)
            self._done = self._unfinished == 0
        return self._pending.pop(0)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()


def dispatch(sinks: dict[str, Sink], outputs: Iterable[RequestOutput],
             finished: Callable[[str], None] | None = None) -> None:
    """Hand each output to its request's sink; a sink leaves `sinks` (and `finished` hears its request
    id) with its last choice's finished output. One wake-up per event loop per call, not one per
    request: each call_soon_threadsafe writes the loop's self-pipe, and with hundreds of streams that
    cost showed up."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, RequestOutput]]] = {}
    for out in outputs:
        sink = sinks.get(out.request_id)
        if sink is None:
            continue
        if out.finished:
            sink.unfinished -= 1
            if sink.unfinished == 0:
                del sinks[out.request_id]
                if finished is not None:
                    finished(out.request_id)
        by_loop.setdefault(sink.loop, []).append((sink, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more


def _deliver(items: list[tuple[Sink, RequestOutput]]) -> None:
    for sink, out in items:
        sink.offer(out)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # read-only attributes (tokenizer, max_model_len, ...) are safe to share
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._sinks: dict[str, Sink] = {}  # touched by the loop thread only
        self._stats_lock = threading.Lock()
        self._stats = engine.stats()
        self._detokenizer = engine.detokenizer  # the front end's, built here rather than in a first request
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
        sink = Sink(loop, n, text=RequestText(self._detokenizer, request.params, self._abort_choice))
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

    def _abort_choice(self, abort: ChoiceAbort) -> None:
        """A stop string ended one choice in the front end; a dead engine has ended it anyway."""
        try:
            self._send(("abort_choice", abort))
        except EngineDeadError:
            pass

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
            pin_thread(engine.config.device.cpu_affinity)  # the step loop (and threads it starts) on the engine's cores
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
            elif kind == "abort_choice":
                self.engine.abort_choice(cmd[1])
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


# ---- InProcessEngineClient ----
# The EngineClient over an AsyncEngine in this process (the step loop on its own thread): the LLM API's
# mode, the tests' where they need the engine in reach, and the server's with `--engine-process in-process`.


class InProcessEngineClient(EngineClient):
    """`engine` (the LLMEngine itself), call() and post() are this mode's own: for tests and the
    in-process LLM API. The HTTP side never reads them (tests/server/api/test_engine_boundary.py)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # read-only attributes (tokenizer, ...) are safe to share; the rest is the loop's
        self._loop = AsyncEngine(engine)
        self.info = engine_info(engine)

    @classmethod
    def build(cls, config: EngineConfig, adapter_source: Fetch | None = None,
              dora_scale_store: ScaleStore | None = None) -> "InProcessEngineClient":
        """Blocking: loads the weights and sizes the pools."""
        return cls(LLMEngine(config, adapter_source, dora_scale_store))

    # ---- lifecycle and health ----
    def start(self) -> None:
        self._loop.start()

    def shutdown(self) -> None:
        self._loop.shutdown()
        self.engine.shutdown()

    @property
    def is_healthy(self) -> bool:
        return self._loop.is_healthy

    @property
    def error(self) -> str | None:
        return self._loop.error

    # ---- requests ----
    async def submit(self, request: EngineRequest) -> RequestStream:
        return await self._loop.submit(request)

    def abort(self, request_id: str) -> None:
        self._loop.abort(request_id)

    # ---- adapters ----
    async def add_adapter(self, version_id: str, adapter: LoraAdapter) -> None:
        await self._loop.add_adapter(version_id, adapter)

    async def remove_adapter(self, version_id: str) -> None:
        await self._loop.remove_adapter(version_id)

    def remove_adapter_nowait(self, version_id: str) -> None:
        self._loop.remove_adapter_nowait(version_id)

    async def release_adapter_memory(self, version_id: str) -> None:
        await self._loop.call(lambda engine: engine.release_adapter_memory(version_id))

    async def pin_adapter(self, version_id: str, tenant: str | None) -> bool:
        return await self._loop.call(lambda engine: engine.pin_adapter(version_id, tenant))

    async def unpin_adapter(self, version_id: str) -> bool:
        return await self._loop.call(lambda engine: engine.unpin_adapter(version_id))

    async def has_adapter(self, version_id: str) -> bool:
        return await self._loop.has_adapter(version_id)

    async def adapter_residency(self) -> dict[str, str]:
        return await self._loop.call(residency)

    async def adapter_tiers(self) -> AdapterTiers:
        return await self._loop.call(adapter_tiers)

    def held_adapter_versions(self, timeout: float) -> set[str]:
        return self._loop.call_soon(held_versions).result(timeout=timeout)

    def precompute_dora(self, version_id: str, adapter: LoraAdapter) -> concurrent.futures.Future[str]:
        return self.engine.dora_precompute.submit(version_id, adapter)  # its own thread, not the loop's

    def nap(self, seconds: float) -> concurrent.futures.Future[None]:
        return self._loop.call_soon(lambda e: nap(seconds))

    # ---- structured output ----
    def grammar_compiler(self, timeout_ms: int, cpus: tuple[int, ...] | None = None) -> GrammarCompileService:
        return GrammarCompileService(self.engine.grammars, timeout_ms, cpus=cpus)

    # ---- stats ----
    def stats(self) -> EngineStats:
        return self._loop.stats()

    def snapshot(self) -> EngineSnapshot:
        return engine_snapshot(self.engine, self._loop.stats())

    def take_load_times(self) -> LoadTimes:
        return take_load_times(self.engine)

    # ---- in-process only ----
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn on the loop thread and wait for its result."""
        return await self._loop.call(fn)

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run fn on the loop thread without waiting; ordered with every other command."""
        self._loop.post(fn)

