"""InputSocket: the core's thread that reads the front ends' messages, bounds and decodes them, and
hands the busy loop ready-made commands (prompt ids unpacked, grammars bound to the tokenizer).

Bounded before decoding: ZMQ refuses a message over max_message_bytes while reading its header
(ZMQ_MAXMSGSIZE; the sender's connection is dropped and it reconnects), so an oversized message never
takes the core's memory; a message of more than one frame has its extra frames read and dropped one
by one. A malformed one (not msgpack, not one of the FrontMessage types, or failing their checks) is
counted in `refused` and dropped; msgspec checks every length against the bytes actually there, so a
small message cannot claim a huge array either.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

import msgspec
import zmq

from server.engine.choice_abort import ChoiceAbort
from server.engine.core.queue_items import AbortRequests, AddRequest, Call, PeerHello, Send, Stop
from server.engine.core.arrays import ints
from server.engine.core.commands import FETCH_OPS, LOOP_OPS, NAP, SHUTDOWN, nap
from server.engine.core.messages import Abort, AbortChoice, Accepted, Command, FrontMessage, Hello, Submit

if TYPE_CHECKING:
    from server.engine.core.commands import FetchingCommands
    from server.engine.grammar import Grammars

log = logging.getLogger(__name__)


class InputSocket(threading.Thread):
    def __init__(self, ctx: zmq.Context, address: str, max_message_bytes: int, inbox: queue.SimpleQueue,
                 outbox: queue.SimpleQueue) -> None:
        super().__init__(name="core-input", daemon=True)
        self._socket = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)  # here, so that the address exists once the constructor returns
        self._inbox = inbox
        self._outbox = outbox
        self._decoder = msgspec.msgpack.Decoder(FrontMessage)
        self._grammars: Grammars | None = None
        self._fetching: FetchingCommands | None = None
        self.refused = 0  # malformed messages (written by this thread only)

    def attach(self, grammars: Grammars, fetching: FetchingCommands) -> None:
        """The engine is built: requests and commands are served from now on."""
        self._grammars, self._fetching = grammars, fetching

    def run(self) -> None:
        sock = self._socket
        while True:
            owner = sock.recv()
            payload = sock.recv(copy=False) if sock.getsockopt(zmq.RCVMORE) else None
            extra = 0
            while sock.getsockopt(zmq.RCVMORE):
                sock.recv(copy=False)
                extra += 1
            if payload is None or extra:
                self._refuse(owner, f"{1 + extra if payload is not None else 0} frames, not 1")
                continue
            try:
                message = self._decoder.decode(payload.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
                self._refuse(owner, str(e))
                continue
            self._handle(owner, message)

    def _refuse(self, owner: bytes, why: str) -> None:
        self.refused += 1
        log.warning("refused a malformed message from front end %r: %s", owner[:32], why[:200])

    def _handle(self, owner: bytes, message) -> None:
        if isinstance(message, Hello):
            self._outbox.put(PeerHello(owner, message.output_address))
        elif self._grammars is None or self._fetching is None:
            self._refuse(owner, "the engine is not ready")  # a front end waits for Ready before sending
        elif isinstance(message, Submit):
            self._submit(owner, message)
        elif isinstance(message, Abort):
            self._inbox.put(AbortRequests(message.request_ids))
        elif isinstance(message, AbortChoice):
            self._inbox.put(ChoiceAbort(message.request_id, message.index, message.kept))
        elif isinstance(message, Command):
            self._command(owner, message)

    def _submit(self, owner: bytes, m: Submit) -> None:
        grammar = None
        if m.grammar_json is not None:
            try:
                grammar = self._grammars.deserialize(m.grammar_json)
            except Exception as e:  # noqa: BLE001 - the request's fault
                self._outbox.put(Send(owner, Accepted(m.request_id, f"the compiled grammar is invalid: {e}",
                                                      invalid=True)))
                return
        self._inbox.put(AddRequest(owner, m.request_id, ints(m.prompt_ids), m.params, version_id=m.version_id,
                                   tenant=m.tenant, priority=m.priority, tenant_weight=m.tenant_weight,
                                   cache_salt=m.cache_salt, grammar=grammar))

    def _command(self, owner: bytes, m: Command) -> None:
        if m.op in LOOP_OPS:
            op = LOOP_OPS[m.op]
            self._inbox.put(Call(owner, m.call_id, lambda engine: op(engine, m)))
        elif m.op in FETCH_OPS and m.version_id is not None:
            self._fetching.run(owner, m.call_id, m.op, m.version_id)
        elif m.op == NAP:
            seconds = m.seconds
            self._inbox.put(Call(owner, m.call_id, lambda engine: nap(seconds)))
        elif m.op == SHUTDOWN:
            self._inbox.put(Stop())
        else:
            self._refuse(owner, f"unknown command {m.op[:40]!r}")
