"""OutputSocket: the core's thread that encodes what the busy loop says and sends it to the front end
it concerns, each over its own PUSH socket (connected to the address its Hello named): a request's
outputs go back to the front end that submitted it. Every STATS_INTERVAL_S it pushes each front end
the engine's snapshot, which is also the front ends' heartbeat, and checks that its parent (the
front end that started it) is still there.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from server.engine.core.deltas import DeltaEncoder
from server.engine.core.front_end_watch import FrontEndWatch
from server.engine.core.messages import STATS_INTERVAL_S, Fatal, OutputDelta, Outputs, Ready, Reply, Stats
from server.engine.core.queue_items import CoreFatal, CoreReady, Flush, PeerHello, Send, StepOutputs, Track

log = logging.getLogger(__name__)


class OutputSocket(threading.Thread):
    """Reads the outbox's items (server.engine.core.queue_items) and sends what they say."""

    def __init__(self, ctx: zmq.Context, outbox: queue.SimpleQueue, parent_pid: int,
                 refused: Callable[[], int]) -> None:
        super().__init__(name="core-output", daemon=True)
        self._ctx = ctx
        self._outbox = outbox
        self._front_end = FrontEndWatch(parent_pid)
        self._refused = refused
        self._encoder = msgspec.msgpack.Encoder()
        self._deltas = DeltaEncoder()
        self._peers: dict[bytes, zmq.Socket] = {}
        self._ready: CoreReady | None = None

    def run(self) -> None:
        next_beat = time.monotonic()
        while True:
            try:
                item = self._outbox.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                item = None
            if item is not None:
                self._handle(item)
            if time.monotonic() >= next_beat:
                self._beat()
                next_beat = time.monotonic() + STATS_INTERVAL_S

    def _handle(self, item: StepOutputs | Send | Track | PeerHello | CoreReady | CoreFatal | Flush) -> None:
        if isinstance(item, StepOutputs):
            by_owner: dict[bytes, list[OutputDelta]] = {}
            for out in item.outputs:
                routed = self._deltas.encode(out)
                if routed is not None:
                    by_owner.setdefault(routed[0], []).append(routed[1])
            if by_owner:
                snapshot = self._ready.snapshot()
                for owner, deltas in by_owner.items():
                    self._send(owner, Outputs(deltas, snapshot))
        elif isinstance(item, Send):
            message = item.message
            if isinstance(message, Reply) and self._ready is not None:
                message.snapshot = self._ready.snapshot()  # the caller then reads stats at least as new as its command
            self._send(item.owner, message)
        elif isinstance(item, Track):
            self._deltas.track(item.request_id, item.owner, item.n)
        elif isinstance(item, PeerHello):
            self._connect(item.owner, item.address)
        elif isinstance(item, CoreReady):
            self._ready = item
            for owner in self._peers:
                self._send_ready(owner)
        elif isinstance(item, CoreFatal):
            for owner in list(self._peers):
                self._send(owner, Fatal(item.error))
        elif isinstance(item, Flush):
            item.done.set()

    def _connect(self, owner: bytes, address: str) -> None:
        old = self._peers.pop(owner, None)
        if old is not None:  # a front end that said hello again (it reconnected): its old requests are gone
            old.close(0)
            self._deltas.drop_owner(owner)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # the front end's receiver thread reads at once; never block the loop's outputs
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            log.warning("front end %r gave an address that cannot be connected: %s", owner[:32], e)
            sock.close(0)
            return
        self._peers[owner] = sock
        if self._ready is not None:
            self._send_ready(owner)

    def _send_ready(self, owner: bytes) -> None:
        ready = self._ready
        self._send(owner, Ready(ready.info, ready.snapshot(), ready.pid))

    def _send(self, owner: bytes, message) -> None:
        sock = self._peers.get(owner)
        if sock is not None:
            sock.send(self._encoder.encode(message), copy=False)

    def _beat(self) -> None:
        if self._front_end.gone():
            log.error("the front end (pid %d) is gone: the engine core exits", self._front_end.pid)
            os._exit(1)
        if self._ready is None or not self._peers:
            return
        times = self._ready.take_load_times()
        stats = Stats(self._ready.snapshot(), times.host, self._refused(), times.device)
        for owner in self._peers:
            self._send(owner, stats)
