"""Which adapter versions the engine holds, and where: read on the step loop's thread (the tiers are
its), by the in-process client and by the engine core alike."""
from __future__ import annotations

from typing import TYPE_CHECKING

from server.engine.protocol.residency import AdapterTiers, LoadTimes

if TYPE_CHECKING:
    from server.engine.llm_engine import LLMEngine


def residency(engine: LLMEngine) -> dict[str, str]:
    """version -> the fastest tier holding it ("device" or "host")."""
    where = {v: "host" for v in engine.host.entries}
    where.update({v: "device" for v in engine.lora_slots.slot_of})
    return where


def held_versions(engine: LLMEngine) -> set[str]:
    """Every version in any tier, loading and parked ones included."""
    host = engine.host
    return set(host.entries) | set(host.loading) | set(host.parked) | set(engine.lora_slots.slot_of)


def adapter_tiers(engine: LLMEngine) -> AdapterTiers:
    """Every tier's versions: a version in a device slot may be in host memory too (or evicted from it)."""
    return AdapterTiers(device=sorted(engine.lora_slots.slot_of), host=sorted(engine.host.entries))


def take_load_times(engine: LLMEngine) -> LoadTimes:
    """The load durations recorded since the last call, per tier (for one reader: metrics); appended by
    the loader threads and the step loop."""
    return LoadTimes.drained(engine.host.load_seconds, engine.scheduler.slot_load_seconds)
