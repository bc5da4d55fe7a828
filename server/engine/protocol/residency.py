"""AdapterTiers: which adapter versions each of the engine's tiers holds, read in one step of its loop.

For routers and operators (vllm:lora_adapter_loaded, /admin/engine): the per-version view that
EngineStats leaves out, because EngineStats is published every step and this grows with the fleet."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterTiers:
    device: list[str]  # versions in device slots, sorted
    host: list[str]  # versions in host memory (parsed, in the serving dtype), sorted

    @classmethod
    def of(cls, value: AdapterTiers | dict) -> AdapterTiers:
        """From an engine core's reply (a transport sends a dataclass as a map)."""
        return value if isinstance(value, cls) else cls(**value)


@dataclass(frozen=True)
class LoadTimes:
    """Adapter load durations, in seconds, since the last time they were taken, per tier."""
    host: list[float]  # Redis -> host memory: fetch, parse, pin (on the loader threads)
    device: list[float]  # host memory -> a device slot, as the step loop spends it

    @classmethod
    def drained(cls, host: deque[float], device: deque[float]) -> LoadTimes:
        """Take every duration from the two records (deques: other threads may append meanwhile)."""
        return cls(host=_drain(host), device=_drain(device))


def _drain(seconds: deque[float]) -> list[float]:
    taken = []
    while seconds:
        taken.append(seconds.popleft())
    return taken
