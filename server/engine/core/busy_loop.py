"""EngineCore: the core process's step loop. It reads commands from one in-memory queue and writes
what it has to say to another; the socket threads around it do every (de)serialisation."""
from __future__ import annotations

import logging
import queue

from server.engine.core.commands import reply_of
from server.engine.core.messages import Accepted
from server.engine.llm_engine import LLMEngine, RequestError
from server.engine.protocol.snapshot import EngineSnapshot, engine_snapshot

log = logging.getLogger(__name__)


class EngineCore:
    """inbox items: ("add", owner, request_id, prompt_ids, params, version_id, tenant, priority,
    tenant_weight, cache_salt, grammar), ("abort", request_ids), ("call", owner, call_id, fn), ("stop",).
    outbox items (server.engine.core.output_socket): ("track", ...), ("send", owner, message), ("outputs", list)."""

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
                    self._outbox.put(("outputs", outputs))

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

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            self._add(*item[1:])
        elif kind == "abort":
            for request_id in item[1]:
                self.engine.abort_request(request_id)
        elif kind == "call":
            _, owner, call_id, fn = item
            reply = reply_of(call_id, lambda: fn(self.engine))
            self._stats = self.engine.stats()  # the reply's snapshot shows the command done
            if call_id:
                self._outbox.put(("send", owner, reply))
            elif reply.error is not None:
                log.error("engine command failed: %s", reply.error)
        elif kind == "stop":
            self._stopping = True
        else:
            raise AssertionError(f"unknown command {kind!r}")

    def _add(self, owner: bytes, request_id: str, prompt_ids: list[int], params, version_id, tenant, priority,
             tenant_weight, cache_salt, grammar) -> None:
        try:
            self.engine.add_request(request_id, prompt_ids, params, version_id, tenant, priority, tenant_weight,
                                    cache_salt=cache_salt, grammar=grammar)
        except RequestError as e:
            self._outbox.put(("send", owner, Accepted(request_id, str(e), invalid=True)))
            return
        except Exception as e:  # noqa: BLE001 - handed to the caller
            log.exception("adding request %s failed", request_id)
            self._outbox.put(("send", owner, Accepted(request_id, f"{type(e).__name__}: {e}")))
            return
        # Tracked before the verdict, on the same queue: its first output cannot overtake either.
        self._outbox.put(("track", request_id, owner, params.n))
        self._outbox.put(("send", owner, Accepted(request_id)))
