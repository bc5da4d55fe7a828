"""RemoteEngineClient: the EngineClient over an engine-core process (server.engine.core), ZMQ + msgpack.

This process binds a PULL socket for what the core sends it and connects a DEALER (its identity: a
random client id) to the core's input socket; its Hello names the PULL address, so the core routes
this client's outputs, replies and stats back here and nowhere else. One receiver thread decodes what
arrives and hands each request's outputs to its stream's event loop, one wake-up per loop per message.

Death is noticed within a poll interval: a thread waits on the core process (kill -9 ends the wait
at once), and the receiver treats HEARTBEAT_TIMEOUT_S without a message (the core pushes stats every
0.25 s from its output thread, whatever its step loop does) as a hung core, which it kills. Then every
open stream ends with EngineDeadError (the HTTP side's SSE error event), every waiting call raises it,
and submit() raises it (a 503 with Retry-After) from then on.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING

import msgspec
import zmq

from server.engine.core.arrays import int_bytes
from server.engine.core.deltas import OutputAssembler
from server.engine.core.launch import CoreLaunch
from server.engine.core.launcher import spawn_core
from server.engine.core.messages import (Abort, Accepted, Command, CoreMessage, Fatal, Hello, Outputs, Ready, Reply,
                                         Stats, Submit)
from server.engine.engine_stats import EngineStats
from server.engine.grammar import Grammars
from server.engine.grammar_worker import GrammarCompileService
from server.engine.protocol.client import EngineClient
from server.engine.protocol.errors import EngineDeadError, RequestError
from server.engine.protocol.request import EngineRequest
from server.engine.protocol.residency import AdapterTiers, LoadTimes
from server.engine.protocol.snapshot import EngineSnapshot
from server.engine.request_stream import RequestStream, Sink, dispatch
from server.engine.tokenizer_loader import load_tokenizer

if TYPE_CHECKING:
    from adapters.format import LoraAdapter

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 3.0  # 12 missed stats pushes: the core's output thread is stuck or gone
POLL_MS = 100
SHUTDOWN_WAIT_S = 10.0


class RemoteEngineClient(EngineClient):
    def __init__(self, launch: CoreLaunch, workdir: str) -> None:
        self._launch = launch
        self._workdir = workdir
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._client_id = uuid.uuid4().bytes
        output_address = f"ipc://{workdir}/out-{uuid.uuid4().hex[:8]}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(output_address)
        self._push = self._ctx.socket(zmq.DEALER)
        self._push.setsockopt(zmq.ROUTING_ID, self._client_id)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(launch.input_address)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the tables below: the event loop adds, the receiver thread removes
        self._sinks: dict[str, Sink] = {}
        self._accepting: dict[str, concurrent.futures.Future] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._assembler = OutputAssembler()
        self._call_ids = itertools.count(1)
        self._ready = threading.Event()
        self._snapshot: EngineSnapshot | None = None
        self._grammars: Grammars | None = None  # grammar_compiler()'s
        self._load_seconds: deque[float] = deque()  # Redis -> host, from the core's Stats
        self._device_load_seconds: deque[float] = deque()  # host -> a device slot
        self.refused_messages = 0  # as the core last reported
        self.core_pid: int | None = None
        self._error: str | None = None
        self._stopping = False
        self._last_heard = time.monotonic()
        self._proc: subprocess.Popen | None = None
        self._send(Hello(output_address))

    @classmethod
    def build(cls, launch_without_address: CoreLaunch, ready_timeout: float | None = None) -> "RemoteEngineClient":
        """Blocking: starts the core and waits until its engine is built (weights loaded, pools sized)."""
        workdir = tempfile.mkdtemp(prefix="loraplex-core-")
        launch = msgspec.structs.replace(launch_without_address, input_address=f"ipc://{workdir}/in",
                                         parent_pid=os.getpid())
        client = cls(launch, workdir)
        try:
            client._start_core(ready_timeout)
        except BaseException:
            client.shutdown()
            raise
        return client

    def _start_core(self, ready_timeout: float | None) -> None:
        self._proc = spawn_core(self._launch)
        threading.Thread(target=self._receive, name="core-receiver", daemon=True).start()
        threading.Thread(target=self._watch, name="core-watch", daemon=True).start()
        deadline = None if ready_timeout is None else time.monotonic() + ready_timeout
        while not self._ready.wait(0.1):
            if self._error is not None:
                raise RuntimeError(f"the engine core did not start: {self._error}")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"the engine core was not ready within {ready_timeout:g} s")

    # ---- lifecycle and health ----
    def start(self) -> None:
        """The core's loop runs from Ready on: nothing to start."""

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                self._send(Command(0, "shutdown"))
                proc.wait(SHUTDOWN_WAIT_S)
            except (EngineDeadError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._workdir, ignore_errors=True)

    @property
    def is_healthy(self) -> bool:
        return self._ready.is_set() and self._error is None and not self._stopping

    @property
    def error(self) -> str | None:
        return self._error

    # ---- requests ----
    async def submit(self, request: EngineRequest) -> RequestStream:
        loop = asyncio.get_running_loop()
        rid, n = request.request_id, request.params.n
        sink = Sink(loop, asyncio.Queue(), n)
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_alive()
            self._sinks[rid] = sink
            self._accepting[rid] = accepted
            self._assembler.track(rid, request.prompt_ids)
        grammar = None if request.grammar is None else request.grammar.serialize_json()
        try:
            self._send(Submit(rid, int_bytes(request.prompt_ids), request.params, request.version_id,
                              request.tenant, request.priority, request.tenant_weight, request.cache_salt, grammar))
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(rid)  # it may have been added just before we gave up
            self._forget(rid)
            raise
        except BaseException:
            self._forget(rid)
            raise
        return RequestStream(self, rid, sink, n)

    def abort(self, request_id: str) -> None:
        if self._error is None and not self._stopping:
            try:
                self._send(Abort([request_id]))
            except EngineDeadError:
                pass  # the core is gone: so is the request

    # ---- adapters (the core fetches a version from the registry itself: the id is all that crosses) ----
    async def add_adapter(self, version_id: str, adapter: LoraAdapter) -> None:
        await self._ask("add_adapter", version_id)

    async def remove_adapter(self, version_id: str) -> None:
        await self._ask("remove_adapter", version_id)

    def remove_adapter_nowait(self, version_id: str) -> None:
        self._send(Command(0, "remove_adapter", version_id))

    async def release_adapter_memory(self, version_id: str) -> None:
        await self._ask("release_adapter_memory", version_id)

    async def has_adapter(self, version_id: str) -> bool:
        return await self._ask("has_adapter", version_id)

    async def adapter_residency(self) -> dict[str, str]:
        return await self._ask("adapter_residency")

    async def adapter_tiers(self) -> AdapterTiers:
        return AdapterTiers.of(await self._ask("adapter_tiers"))

    def held_adapter_versions(self, timeout: float) -> set[str]:
        return set(self._call("held_versions").result(timeout=timeout))

    def precompute_dora(self, version_id: str, adapter: LoraAdapter) -> concurrent.futures.Future[str]:
        return self._call("precompute_dora", version_id)

    # ---- structured output ----
    def grammar_compiler(self, timeout_ms: int) -> GrammarCompileService:
        """Compiled here, as in the in-process mode (deadline, tenant charges, the compile processes),
        for this front end's own copy of the vocabulary; the compiled grammar crosses serialised."""
        self._grammars = Grammars(load_tokenizer(self._launch.engine.model), self.info.vocab_size,
                                  self.info.eos_token_ids)
        return GrammarCompileService(self._grammars, timeout_ms)

    # ---- stats ----
    def stats(self) -> EngineStats:
        return self.snapshot().stats

    def snapshot(self) -> EngineSnapshot:
        """The core's last push, its grammar counters this front end's (the compiles and their cache are here)."""
        snap = self._snapshot
        if self._grammars is None:
            return snap
        return dataclasses.replace(snap, stats=dataclasses.replace(snap.stats, grammar=self._grammars.stats()))

    def take_load_times(self) -> LoadTimes:
        return LoadTimes.drained(self._load_seconds, self._device_load_seconds)

    # ---- the wire ----
    def _check_alive(self) -> None:
        if self._error is not None or self._stopping:
            raise EngineDeadError(f"the engine is not running ({self._error or 'shut down'})")

    def _send(self, message) -> None:
        data = self._encoder.encode(message)
        with self._send_lock:
            try:
                self._push.send(data, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise EngineDeadError("the engine core is not reading its input") from None
            except zmq.ZMQError as e:
                raise EngineDeadError(f"the engine core's socket failed: {e}") from None

    def _call(self, op: str, version_id: str | None = None) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._lock:
            self._check_alive()
            self._calls[call_id] = done
        try:
            self._send(Command(call_id, op, version_id))
        except BaseException:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        return done

    async def _ask(self, op: str, version_id: str | None = None):
        return await asyncio.wrap_future(self._call(op, version_id))

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)
            self._accepting.pop(request_id, None)
            self._assembler.drop(request_id)

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stopping and self._error is None:
            try:
                ready = poller.poll(POLL_MS)
                if not ready:
                    if self._ready.is_set() and time.monotonic() - self._last_heard > HEARTBEAT_TIMEOUT_S:
                        self._die(f"the engine core sent nothing for {HEARTBEAT_TIMEOUT_S:g} s")
                        if self._proc is not None:
                            self._proc.kill()
                    continue
                message = self._decoder.decode(self._pull.recv(copy=False).buffer)
            except zmq.ZMQError:
                return  # the context was destroyed: shut down
            self._last_heard = time.monotonic()
            self._handle(message)

    def _handle(self, message) -> None:
        if isinstance(message, Outputs):
            self._deliver(message)
        elif isinstance(message, Accepted):
            with self._lock:
                done = self._accepting.pop(message.request_id, None)
            if done is not None:
                error = message.error
                _settle(done, None, None if error is None else RequestError(error) if message.invalid
                        else RuntimeError(error))
        elif isinstance(message, Reply):
            with self._lock:
                done = self._calls.pop(message.call_id, None)
            if message.snapshot is not None:
                self._snapshot = message.snapshot
            if done is not None:
                _settle(done, message.value, None if message.error is None else RuntimeError(message.error))
        elif isinstance(message, Stats):
            self._snapshot = message.snapshot
            self._load_seconds.extend(message.load_seconds)
            self._device_load_seconds.extend(message.device_load_seconds)
            self.refused_messages = message.refused_messages
        elif isinstance(message, Ready):
            self.info, self._snapshot, self.core_pid = message.info, message.snapshot, message.pid
            self._ready.set()
        elif isinstance(message, Fatal):
            self._die(f"the engine core failed: {message.error}")

    def _deliver(self, message: Outputs) -> None:
        self._snapshot = message.snapshot  # first: a stream woken below finds stats at least this new
        with self._lock:
            outputs = [self._assembler.apply(delta) for delta in message.outputs]
            dispatch(self._sinks, [out for out in outputs if out is not None], self._assembler.drop)

    def _watch(self) -> None:
        code = self._proc.wait()
        if not self._stopping:
            self._die(f"the engine core exited with status {code}")

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = reason
        log.error("%s", reason)
        self._fail_all(EngineDeadError(f"the engine is not running ({reason})"))

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            waiting = [*self._accepting.values(), *self._calls.values()]
            self._accepting, self._calls = {}, {}
        for sink in sinks.values():
            sink.put(error)
        for done in waiting:
            _settle(done, None, error)


def _settle(done: concurrent.futures.Future, value, error: BaseException | None) -> None:
    """Off the caller's thread: a caller that gave up has cancelled the future meanwhile."""
    try:
        if error is None:
            done.set_result(value)
        else:
            done.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
