"""How the engine reaches the Redis registry: a loader for versions, and a listener for retirements.

The engine pages adapters Redis -> host -> device itself (adapters.host_tier);
it only needs a callable that turns a version id into a parsed adapter. The
listener makes every server process sharing the Redis drop a deleted or
replaced version from its tiers, not just the one that handled the request.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Callable

import redis

from adapters.format import LoraAdapter, ModelShape, load_adapter_bytes
from adapters.registry import AdapterRegistry

log = logging.getLogger(__name__)


def registry_fetch(registry: AdapterRegistry, shape: ModelShape, max_lora_rank: int) -> Callable[[str], LoraAdapter]:
    """Runs on the engine's loader threads: read the version's files and validate them again."""

    def fetch(version: str) -> LoraAdapter:
        config_json, weights = registry.read_files(version)
        return load_adapter_bytes(config_json, weights, shape, max_lora_rank)

    return fetch


class RetirementListener:
    """Subscribes to the registry's events; calls `retire(version)` for each deleted or replaced version."""

    def __init__(self, client: redis.Redis, channel: str, retire: Callable[[str], None]) -> None:
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(channel)
        self._retire = retire
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adapter-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pubsub.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                message = self._pubsub.get_message(timeout=0.5)
            except (redis.ConnectionError, ValueError):  # closing, or Redis went away: stop quietly
                if not self._stop.is_set():
                    log.warning("adapter event subscription lost")
                return
            if message is None or message.get("type") != "message":
                continue
            try:
                event = json.loads(message["data"])
                if event.get("event") in ("deleted", "replaced"):
                    self._retire(str(event["version"]))
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring malformed adapter event %r", message.get("data"))
