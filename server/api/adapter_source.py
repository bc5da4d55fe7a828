"""How the engine hears of retired versions (its loader of versions: adapters.registry_fetch).

The listener makes every server process sharing the Redis drop a deleted or
replaced version from its tiers, not just the one that handled the request.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Callable

import redis

log = logging.getLogger(__name__)


class RetirementListener:
    """Subscribes to the registry's events; calls `retire(version)` for each deleted or replaced version.

    The subscription survives Redis outages: on any error it reconnects with backoff, and each
    time it (re)subscribes it resynchronises, asking the registry which of the versions this
    process holds (`held()`) were retired meanwhile (`retired(versions)`), since events published
    while it was away are lost (Redis pub/sub does not queue them).
    """

    def __init__(self, client: redis.Redis, channel: str, retire: Callable[[str], None],
                 held: Callable[[], set[str]], retired: Callable[[set[str]], set[str]]) -> None:
        self._client = client
        self._channel = channel
        self._retire = retire
        self._held = held
        self._retired = retired
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.subscriptions = 0  # how many times it (re)subscribed
        self.resynced = 0  # versions retired by a resync, not by an event
        self.connected = threading.Event()

    def start(self) -> None:
        """Listen on a thread of its own; after stop(), start() listens (and resyncs) again."""
        assert self._thread is None or not self._thread.is_alive(), "already listening"
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="adapter-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.connected.clear()

    def _run(self) -> None:
        delay = _MIN_BACKOFF
        while not self._stop.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self._channel)
                self.subscriptions += 1
                self._resync()
                self.connected.set()
                delay = _MIN_BACKOFF
                self._listen(pubsub)
            except (redis.RedisError, OSError, ValueError) as e:  # ValueError: closed while reading
                self.connected.clear()
                if not self._stop.is_set():
                    log.warning("adapter event subscription lost (%r); reconnecting in %.1f s", e, delay)
                    self._stop.wait(delay)
                    delay = min(_MAX_BACKOFF, delay * 2)
            finally:
                pubsub.close()

    def _listen(self, pubsub) -> None:
        while not self._stop.is_set():
            message = pubsub.get_message(timeout=0.5)
            if message is None or message.get("type") != "message":
                continue
            try:
                event = json.loads(message["data"])
                if event.get("event") in ("deleted", "replaced"):
                    self._retire(str(event["version"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("ignoring malformed adapter event %r", message.get("data"))

    def _resync(self) -> None:
        held = self._held()
        if held:
            for version in self._retired(held):
                self.resynced += 1
                self._retire(version)


_MIN_BACKOFF = 0.1
_MAX_BACKOFF = 5.0
