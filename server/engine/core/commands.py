"""The commands a front end may send the core (messages.Command.op), and how each runs.

LOOP_OPS run on the busy loop's thread (the tiers are its own). FETCH_OPS need the adapter's
weights, which the core reads from the registry itself (the version id is all that crosses) on a
thread of their own, so a slow Redis read never holds the loop or the input socket.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from server.engine.adapter_residency import adapter_tiers, held_versions, residency
from server.engine.core.messages import Command, Reply
from server.engine.core.queue_items import Call, Send

if TYPE_CHECKING:
    from adapters.format import LoraAdapter
    from server.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

MAX_NAP_S = 60.0

LOOP_OPS: dict[str, Callable[[LLMEngine, Command], Any]] = {
    "remove_adapter": lambda e, m: e.remove_adapter(m.version_id),
    "release_adapter_memory": lambda e, m: e.release_adapter_memory(m.version_id),
    "pin_adapter": lambda e, m: e.pin_adapter(m.version_id, m.tenant),
    "unpin_adapter": lambda e, m: e.unpin_adapter(m.version_id),
    "has_adapter": lambda e, m: e.has_adapter(m.version_id),
    "adapter_residency": lambda e, m: residency(e),
    "adapter_tiers": lambda e, m: adapter_tiers(e),
    "held_versions": lambda e, m: sorted(held_versions(e)),
}
FETCH_OPS = ("add_adapter", "precompute_dora")
SHUTDOWN = "shutdown"
NAP = "nap"  # EngineClient.nap: its seconds in Command.seconds


def nap(seconds: float | None) -> None:
    """Hold the loop between two steps (tests and benches that need a request still running)."""
    if seconds is None or not 0 <= seconds <= MAX_NAP_S:
        raise ValueError(f"a nap lasts 0..{MAX_NAP_S:g} s, not {seconds!r}")
    time.sleep(seconds)


def reply_of(call_id: int, run: Callable[[], Any]) -> Reply:
    try:
        return Reply(call_id, run())
    except Exception as e:  # noqa: BLE001 - handed to the caller
        return Reply(call_id, error=f"{type(e).__name__}: {e}")


class FetchingCommands:
    """add_adapter and precompute_dora by version id: fetched from the registry off the loop."""

    def __init__(self, engine: LLMEngine, fetch: Callable[[str], LoraAdapter], inbox: queue.SimpleQueue,
                 outbox: queue.SimpleQueue) -> None:
        self._engine = engine
        self._fetch = fetch
        self._inbox = inbox
        self._outbox = outbox
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="core-fetch")

    def run(self, owner: bytes, call_id: int, op: str, version: str) -> None:
        self._pool.submit(getattr(self, "_" + op), owner, call_id, version)

    def _add_adapter(self, owner: bytes, call_id: int, version: str) -> None:
        try:
            adapter = self._fetch(version)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            self._outbox.put(Send(owner, Reply(call_id, error=f"{type(e).__name__}: {e}")))
            return
        self._inbox.put(Call(owner, call_id, lambda engine: engine.add_adapter(version, adapter)))

    def _precompute_dora(self, owner: bytes, call_id: int, version: str) -> None:
        try:
            done = self._engine.dora_precompute.submit(version, self._fetch(version))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            self._outbox.put(Send(owner, Reply(call_id, error=f"{type(e).__name__}: {e}")))
            return
        done.add_done_callback(lambda f: self._outbox.put(Send(owner, reply_of(call_id, f.result))))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
