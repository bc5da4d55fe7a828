"""Each tenant's weighted share of the device's adapter slots, and who holds more than theirs.

When the head of the queue has waited long for a slot, the scheduler drains slots to let it in
(server.engine.scheduler). Draining every slot would hand them all, one after another, to a tenant
whose queue holds many distinct adapters: another tenant's resident adapter would be evicted, and its
next request would wait behind that tenant's whole backlog. So only the slots of tenants above their
share drain: `max_loras` split among the tenants holding slots and the head's tenant, by fair-share
weight (a tenant holding a slot counts it once, however many of its requests use it).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from server.engine.sequence import Sequence


@dataclass(frozen=True)
class SlotShare:
    held: Mapping[str | None, int]  # tenant -> distinct adapter versions its running requests hold in slots
    share: Mapping[str | None, float]  # tenant -> its weighted share of the slots

    @classmethod
    def of(cls, running: Iterable[Sequence], lora_slot_of_seq: Mapping[Sequence, int],
           weights: Mapping[str | None, float], max_loras: int, head_tenant: str | None) -> SlotShare:
        versions: dict[str | None, set[str]] = {head_tenant: set()}
        for seq in running:
            if seq in lora_slot_of_seq:
                versions.setdefault(seq.tenant, set()).add(seq.version_id)
        total = sum(weights.get(t, 1.0) for t in versions)
        return cls(held={t: len(v) for t, v in versions.items()},
                   share={t: max_loras * weights.get(t, 1.0) / total for t in versions})

    def over(self, tenant: str | None) -> bool:
        """Whether `tenant` holds more slots than its share (a tenant holding none never is)."""
        return self.held.get(tenant, 0) > self.share.get(tenant, 0.0)
