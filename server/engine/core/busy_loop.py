"""EngineCore: the core process's step loop. It reads commands from one in-memory queue and writes
what it has to say to another; the socket threads around it do every (de)serialisation."""
from __future__ import annotations

import logging
import queue

from server.engine.choice_abort import ChoiceAbort
from server.engine.core.commands import reply_of
from server.engine.core.messages import Accepted
from server.engine.core.queue_items import AbortRequests, AddRequest, Call, Send, StepOutputs, Stop, Track
from server.engine.llm_engine import LLMEngine, RequestError
from server.engine.protocol.snapshot import EngineSnapshot, engine_snapshot

log = logging.getLogger(__name__)


class EngineCore:
    """Reads the inbox's items, writes outbox items (server.engine.core.queue_items)."""

    def __init__(self, engine: LLMEngine, inbox: queue.SimpleQueue, outbox: queue.SimpleQueue) -> None:
        self.engine = engine
        self._inbox = inbox
        self._outbox = outbox
        self._stats = engine.stats()
        self._stopping = False

    def snapshot(self) -> EngineSnapshot:
        """As of the last step or command; read by the output thread (one reference, swapped whole)."""
        return engine_snapshot(self.engine, self._stats)

    def run(self) -> None:
        engine = self.engine
        engine.bind_thread()
        while not self._stopping:
            if not engine.has_unfinished_requests():
                self._stats = engine.stats()  # before sleeping: the snapshot shows the engine idle
                self._drain(block=True)
            else:
                self._drain(block=False)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                # Stats first: a front end woken by an output finds a snapshot at least as new.
                self._stats = engine.stats()
                if outputs:
                    self._outbox.put(StepOutputs(outputs))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: AddRequest | AbortRequests | ChoiceAbort | Call | Stop) -> None:
        if isinstance(item, AddRequest):
            self._add(item)
        elif isinstance(item, AbortRequests):
            for request_id in item.request_ids:
                self.engine.abort_request(request_id)
        elif isinstance(item, ChoiceAbort):
            self.engine.abort_choice(item)
        elif isinstance(item, Call):
            reply = reply_of(item.call_id, lambda: item.fn(self.engine))
            self._stats = self.engine.stats()  # the reply's snapshot shows the command done
            if item.call_id:
                self._outbox.put(Send(item.owner, reply))
            elif reply.error is not None:
                log.error("engine command failed: %s", reply.error)
        elif isinstance(item, Stop):
            self._stopping = True
        else:
            raise AssertionError(f"unknown inbox item {item!r}")

    def _add(self, a: AddRequest) -> None:
        try:
            self.engine.add_request(a.request_id, a.prompt_ids, a.params, a.version_id, a.tenant, a.priority,
                                    a.tenant_weight, cache_salt=a.cache_salt, grammar=a.grammar)
        except RequestError as e:
            self._outbox.put(Send(a.owner, Accepted(a.request_id, str(e), invalid=True)))
            return
        except Exception as e:  # noqa: BLE001 - handed to the caller
            log.exception("adding request %s failed", a.request_id)
            self._outbox.put(Send(a.owner, Accepted(a.request_id, f"{type(e).__name__}: {e}")))
            return
        # Tracked before the verdict, on the same queue: its first output cannot overtake either.
        self._outbox.put(Track(a.request_id, a.owner, a.params.n))
        self._outbox.put(Send(a.owner, Accepted(a.request_id)))
