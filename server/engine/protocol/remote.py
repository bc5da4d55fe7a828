"""RemoteEngineClient: the EngineClient over an engine-core process (server.engine.core), ZMQ + msgpack.

This process binds a PULL socket for what the core sends it and connects a DEALER (its identity: a
random client id) to the core's input socket; its Hello names the PULL address, so the core routes
this client's outputs, replies and stats back here and nowhere else. One receiver thread decodes what
arrives and hands each request's outputs to its stream's event loop, one wake-up per loop per message.
The core's outputs are token ids: their text (detokenizing, stop strings, and the abort a stop string
sends back) is made on that event loop with this front end's own tokenizer (server.engine.output_text).

Death is noticed within a poll interval: a thread waits on the core process (kill -9 ends the wait
at once), and the receiver treats HEARTBEAT_TIMEOUT_S without a message (the core pushes stats every
0.25 s from its output thread, whatever its step loop does) as a hung core, which it kills; time the
receiver itself was held up does not count (server.engine.protocol.core_silence). Then every
open stream ends with EngineDeadError (the HTTP side's SSE error event), every waiting call raises it,
and submit() raises it (a 503 with Retry-After) until a new core is ready: with a RestartPolicy
(--engine-restart) a fresh core is started on a fresh input socket (the receiver's PULL socket stays;
the new core hears of it in its Hello) unless the policy's crash-loop limit is reached, after which
`gave_up` is true and the server exits for its orchestrator. Adapters come back by themselves: the new
core pages a version in from the registry on its first request, as after any eviction.

Attached (`attach`, one of --api-server-count's front ends): the core is the parent process's
(server.front_ends), on an input address that stays the same across its restarts. This client starts
and stops nothing: it notices a death by the core's pid (from Ready) being gone when a poll finds
nothing to read, or by the missing heartbeat, fails what is in flight the same way,
and says Hello again every REHELLO_S until the parent's new core answers Ready (the parent decides
whether there is one; when it gives up it stops this front end).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
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
import psutil
import zmq

from server.engine.choice_abort import ChoiceAbort
from server.engine.core.arrays import int_bytes
from server.engine.core.commands import NAP
from server.engine.core.core_handle import CoreHandle
from server.engine.core.deltas import OutputAssembler
from server.engine.core.launch import CoreLaunch
from server.engine.core.launcher import CoreStarter
from server.engine.core.messages import (Abort, AbortChoice, Accepted, Command, CoreMessage, Fatal, Hello, Outputs,
                                         Ready, Reply, Stats, Submit)
from server.engine.async_engine import RequestStream, Sink, dispatch
from server.engine.engine_stats import EngineStats
from server.engine.grammar import Grammars
from server.engine.grammar_worker import GrammarCompileService
from server.engine.output_text import IncrementalDetokenizer, RequestText
from server.engine.protocol.client import EngineClient
from server.engine.protocol.core_silence import CoreSilence
from server.engine.protocol.errors import EngineDeadError, RequestError
from server.engine.protocol.request import EngineRequest
from server.engine.protocol.residency import AdapterTiers, LoadTimes
from server.engine.protocol.snapshot import EngineSnapshot
from server.engine.tokenizer_loader import load_tokenizer

if TYPE_CHECKING:
    from adapters.format import LoraAdapter

log = logging.getLogger(__name__)

# 40 missed stats pushes: the core's output thread is stuck or gone. Not less: a C call that holds the
# core's GIL (a Triton compile mid-serving) may take seconds, and a false death fails every request in flight.
HEARTBEAT_TIMEOUT_S = 10.0
POLL_MS = 100
STALL_S = 1.0  # the receiver's poll returned this late: it was held up itself, and the gap does not count
SHUTDOWN_WAIT_S = 10.0
REHELLO_S = 0.5


@dataclasses.dataclass
class _Core:
    """One engine-core process and the socket this front end sends it on."""

    number: int  # 0 the first, then one more per restart
    proc: CoreHandle | None  # None: attached, the parent's process
    push: zmq.Socket
    dead: bool = False


class RemoteEngineClient(EngineClient):
    def __init__(self, launch: CoreLaunch, workdir: str, starter: CoreStarter | None,
                 restarts: RestartPolicy | None = None, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self._launch = launch
        self._starter = starter  # None: attached, the core is another process's to start
        self._attached = starter is None
        self._restarts = restarts
        self._workdir = workdir
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._client_id = uuid.uuid4().bytes
        output_address = f"ipc://{workdir}/out-{uuid.uuid4().hex[:8]}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(output_address)
        self._output_address = output_address
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the tables below: the event loop adds, the receiver thread removes
        self._sinks: dict[str, Sink] = {}
        self._accepting: dict[str, concurrent.futures.Future] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._assembler = OutputAssembler()
        self._call_ids = itertools.count(1)
        self._ready = threading.Event()
        self._snapshot: EngineSnapshot | None = None
        self.snapshot_at = 0.0  # time.monotonic() when the last snapshot arrived (the DP router's freshness)
        self._grammars: Grammars | None = None  # grammar_compiler()'s
        self._load_seconds: deque[float] = deque()  # Redis -> host, from the core's Stats
        self._device_load_seconds: deque[float] = deque()  # host -> a device slot
        self.refused_messages = 0  # as the core last reported
        self._core_pid: int | None = None
        self._error: str | None = None
        self._stopping = False
        self._restarting = False
        self.gave_up = False  # the core died and is not being restarted (no policy, or its limit reached)
        self.restarts = 0
        self._served = False  # a core was ready once
        self._silence = CoreSilence(heartbeat_timeout_s, STALL_S)
        self._core: _Core | None = None

    @classmethod
    def build(cls, launch_without_address: CoreLaunch, starter: CoreStarter, ready_timeout: float | None = None,
              restarts: RestartPolicy | None = None,
              heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> "RemoteEngineClient":
        """Blocking: starts the core with `starter` (and restarts it with it) and waits until its engine
        is built (weights loaded, pools sized)."""
        workdir = tempfile.mkdtemp(prefix="loraplex-core-")
        launch = msgspec.structs.replace(launch_without_address, parent_pid=os.getpid())
        client = cls(launch, workdir, starter, restarts, heartbeat_timeout_s)
        try:
            client._start_core(ready_timeout)
            client.detokenizer  # noqa: B018 - built now, not in the first request's submit
        except BaseException:
            client.shutdown()
            raise
        return client

    @classmethod
    def attach(cls, launch: CoreLaunch, input_address: str,
               ready_timeout: float | None = None) -> "RemoteEngineClient":
        """Blocking: a channel of this process's own to a core another process runs at input_address,
        ready once the core says Ready (after its weights load, if it is still starting)."""
        client = cls(launch, tempfile.mkdtemp(prefix="loraplex-front-"), None)
        try:
            client._connect(0, input_address)
            client._send(Hello(client._output_address))
            client._wait_ready(ready_timeout)
            client.detokenizer  # noqa: B018 - built now, not in the first request's submit
        except BaseException:
            client.shutdown()
            raise
        return client

    @functools.cached_property
    def tokenizer(self):
        """This front end's own copy of the model's tokenizer."""
        return load_tokenizer(self._launch.engine.model)

    @functools.cached_property
    def detokenizer(self) -> IncrementalDetokenizer:
        """The core's outputs carry token ids only: their text is made here (server.engine.output_text)."""
        return IncrementalDetokenizer(self.tokenizer)

    def _connect(self, number: int, address: str, proc: CoreHandle | None = None) -> None:
        """This client's DEALER to a core's input socket, replacing the last one."""
        push = self._ctx.socket(zmq.DEALER)
        push.setsockopt(zmq.ROUTING_ID, self._client_id)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(address)
        self._input_address = address
        with self._send_lock:
            old, self._core = self._core, _Core(number, proc, push)
            if old is not None:
                old.push.close(linger=0)
        self._silence.heard()
        if proc is None and number == 0:
            threading.Thread(target=self._receive, name="core-receiver", daemon=True).start()

    def _spawn(self, number: int) -> None:
        """Core `number` on input socket in-`number` (a fresh socket: nothing queued for a dead core
        reaches the new one), with a thread that waits on its process."""
        address = f"ipc://{self._workdir}/in-{number}"
        core = self._starter.start(msgspec.structs.replace(self._launch, input_address=address))
        self._connect(number, address, core)
        self._send(Hello(self._output_address))
        threading.Thread(target=self._watch, args=(self._core,), name=f"core-watch-{number}", daemon=True).start()

    def _start_core(self, ready_timeout: float | None) -> None:
        self._spawn(0)
        threading.Thread(target=self._receive, name="core-receiver", daemon=True).start()
        self._wait_ready(ready_timeout)

    def _wait_ready(self, ready_timeout: float | None) -> None:
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
        proc = None if self._core is None else self._core.proc
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

    @property
    def is_restarting(self) -> bool:
        return self._restarting

    @property
    def input_address(self) -> str:
        """The running core's input socket (each core gets a fresh one)."""
        return self._input_address

    @property
    def core_pid(self) -> int | None:
        """The running core's process id (None before its first Ready)."""
        return self._core_pid

    # ---- requests ----
    async def submit(self, request: EngineRequest) -> RequestStream:
        loop = asyncio.get_running_loop()
        rid, n = request.request_id, request.params.n
        sink = Sink(loop, n, text=RequestText(self.detokenizer, request.params, self._abort_choice))
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

    def _abort_choice(self, abort: ChoiceAbort) -> None:
        """A stop string ended one choice here (server.engine.choice_abort)."""
        if self._error is None and not self._stopping:
            try:
                self._send(AbortChoice(abort.request_id, abort.index, abort.kept))
            except EngineDeadError:
                pass  # the core is gone: so is the request

    # ---- adapters (the core fetches a version from the registry itself: the id is all that crosses) ----
    async def add_adapter(self, version_id: str, adapter: LoraAdapter) -> None:
        await self._ask("add_adapter", version_id)

    async def remove_adapter(self, version_id: str) -> None:
        await self._ask("remove_adapter", version_id)

    def remove_adapter_nowait(self, version_id: str) -> None:
        try:
            self._send(Command(0, "remove_adapter", version_id))
        except EngineDeadError:
            pass  # a dead core holds nothing; a restarted one pages in only what the registry still has

    async def release_adapter_memory(self, version_id: str) -> None:
        await self._ask("release_adapter_memory", version_id)

    async def pin_adapter(self, version_id: str, tenant: str | None) -> bool:
        return await self._ask("pin_adapter", version_id, tenant)

    async def unpin_adapter(self, version_id: str) -> bool:
        return await self._ask("unpin_adapter", version_id)

    async def has_adapter(self, version_id: str) -> bool:
        return await self._ask("has_adapter", version_id)

    async def adapter_residency(self) -> dict[str, str]:
        return await self._ask("adapter_residency")

    async def adapter_tiers(self) -> AdapterTiers:
        return AdapterTiers.of(await self._ask("adapter_tiers"))

    def adapter_tiers_future(self) -> concurrent.futures.Future:
        """adapter_tiers() for a thread off the event loop (the data-parallel router's refresh): the
        core's reply, AdapterTiers.of it."""
        return self._call("adapter_tiers")

    def held_adapter_versions(self, timeout: float) -> set[str]:
        return set(self._call("held_versions").result(timeout=timeout))

    def precompute_dora(self, version_id: str, adapter: LoraAdapter) -> concurrent.futures.Future[str]:
        return self._call("precompute_dora", version_id)

    def nap(self, seconds: float) -> concurrent.futures.Future[None]:
        return self._call(NAP, seconds=seconds)

    # ---- structured output ----
    def grammar_compiler(self, timeout_ms: int, cpus: tuple[int, ...] | None = None) -> GrammarCompileService:
        """Compiled here, as in the in-process mode (deadline, tenant charges, the compile processes),
        for this front end's own copy of the vocabulary; the compiled grammar crosses serialised."""
        self._grammars = Grammars(self.tokenizer, self.info.vocab_size,
                                  self.info.eos_token_ids)
        return GrammarCompileService(self._grammars, timeout_ms, cpus=cpus)

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
            if self._core is None:
                raise EngineDeadError("the engine core has not started")
            try:
                self._core.push.send(data, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise EngineDeadError("the engine core is not reading its input") from None
            except zmq.ZMQError as e:
                raise EngineDeadError(f"the engine core's socket failed: {e}") from None

    def _call(self, op: str, version_id: str | None = None, tenant: str | None = None,
              seconds: float | None = None) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._lock:
            self._check_alive()
            self._calls[call_id] = done
        try:
            self._send(Command(call_id, op, version_id, tenant, seconds))
        except BaseException:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        return done

    async def _ask(self, op: str, version_id: str | None = None, tenant: str | None = None):
        return await asyncio.wrap_future(self._call(op, version_id, tenant))

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)
            self._accepting.pop(request_id, None)
            self._assembler.drop(request_id)

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stopping and not self.gave_up:
            try:
                ready = poller.poll(POLL_MS)
                if not ready:
                    core = self._core
                    if not self.is_healthy:
                        continue
                    if core.proc is None and self._core_pid is not None and not psutil.pid_exists(self._core_pid):
                        self._die(core, f"the engine core (pid {self._core_pid}) exited")
                    elif self._silence.quiet():
                        if core.proc is not None:
                            core.proc.kill()  # first: a restart must not find it still running
                        self._die(core, f"the engine core sent nothing for {self._silence.timeout_s:g} s")
                    continue
                message = self._decoder.decode(self._pull.recv(copy=False).buffer)
            except zmq.ZMQError:
                return  # the context was destroyed: shut down
            self._silence.heard()
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
                self._snapshot, self.snapshot_at = message.snapshot, time.monotonic()
            if done is not None:
                _settle(done, message.value, None if message.error is None else RuntimeError(message.error))
        elif isinstance(message, Stats):
            self._snapshot, self.snapshot_at = message.snapshot, time.monotonic()
            self._load_seconds.extend(message.load_seconds)
            self._device_load_seconds.extend(message.device_load_seconds)
            self.refused_messages = message.refused_messages
        elif isinstance(message, Ready):
            self.info, self._snapshot, self._core_pid = message.info, message.snapshot, message.pid
            self.snapshot_at = time.monotonic()
            with self._lock:
                self._error, self._restarting, self._served = None, False, True  # a restarted core serves again
                self._ready.set()
        elif isinstance(message, Fatal):
            self._die(self._core, f"the engine core failed: {message.error}")

    def _deliver(self, message: Outputs) -> None:
        # first: a stream woken below finds stats at least this new
        self._snapshot, self.snapshot_at = message.snapshot, time.monotonic()
        with self._lock:
            outputs = [self._assembler.apply(delta) for delta in message.outputs]
            dispatch(self._sinks, [out for out in outputs if out is not None], self._assembler.drop)

    def _watch(self, core: _Core) -> None:
        code = core.proc.wait()
        if not self._stopping:
            self._die(core, f"the engine core exited with status {code}")

    def _die(self, core: _Core, reason: str) -> None:
        """Once per core: fail everything in flight, then restart it or give up."""
        with self._lock:
            if core.dead or self._stopping:
                return
            core.dead = True
            self._error = reason
            self._ready.clear()
            # Only a core that served restarts: one that cannot start would fail the same way again.
            restart = self._attached or (self._restarts is not None and self._served
                                         and self._restarts.allow(time.monotonic()))
            self._restarting, self.gave_up = restart, not restart
            self._assembler = OutputAssembler()
        log.error("%s%s", reason, "; starting a new one" if restart else
                  "" if self._restarts is None else " (it never started: not restarting)" if not self._served
                  else f" ({self._restarts.describe()} reached: not restarting)")
        self._fail_all(EngineDeadError(f"the engine is not running ({reason})"))
        if restart:
            target = self._reattach if self._attached else self._restart
            threading.Thread(target=target, args=(core,), name="core-restart", daemon=True).start()

    def _reattach(self, dead: _Core) -> None:
        """Hello on a fresh DEALER to the same address until the parent's next core answers Ready."""
        self.restarts += 1
        self._connect(dead.number + 1, self._input_address)
        while not self._stopping and not self._ready.wait(REHELLO_S):
            try:
                self._send(Hello(self._output_address))
            except EngineDeadError:
                pass  # no core listening yet

    def _restart(self, dead: _Core) -> None:
        if dead.proc.poll() is None:
            dead.proc.kill()
        dead.proc.wait()
        self.restarts += 1
        if self._stopping:
            return
        try:
            self._spawn(dead.number + 1)
        except Exception as e:  # noqa: BLE001 - cannot even start a process: give up, the server exits
            log.exception("could not start a new engine core")
            with self._lock:
                self._error, self._restarting, self.gave_up = f"{self._error}; restart failed: {e}", False, True

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            waiting = [*self._accepting.values(), *self._calls.values()]
            self._accepting, self._calls = {}, {}
        for sink in sinks.values():
            sink.put(error)
        for done in waiting:
            _settle(done, None, error)


@dataclasses.dataclass
class RestartPolicy:
    """--engine-restart: restart a dead core unless max_restarts restarts happened in the last window_s
    seconds already (a crash loop: then the server exits non-zero for its orchestrator)."""

    max_restarts: int
    window_s: float
    _times: deque = dataclasses.field(default_factory=deque)

    def allow(self, now: float) -> bool:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    def describe(self) -> str:
        return f"{self.max_restarts} restarts within {self.window_s:g} s"


def _settle(done: concurrent.futures.Future, value, error: BaseException | None) -> None:
    """Off the caller's thread: a caller that gave up has cancelled the future meanwhile."""
    try:
        if error is None:
            done.set_result(value)
        else:
            done.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
