"""The waiting queue, ordered by tenant fair share (virtual token counters, as in VTC).

Each tenant's counter is charged its prompt tokens (when admitted) and its
output tokens (as generated), divided by the tenant's weight; the backlogged
tenant with the lowest counter goes next, so one tenant flooding the queue
cannot starve the others. A tenant returning from idle is lifted to the
lowest counter among active tenants, so idling does not bank credit.
Within a tenant: lower `priority` value first, then arrival order.
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator

from server.engine.sequence import Sequence

PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0  # decode tokens cost a forward each; S-LoRA's VTC weighs them 2x


class FairQueue:
    def __init__(self) -> None:
        self.queues: dict[str | None, list[tuple[int, int, Sequence]]] = {}  # tenant -> sorted (prio, arrival, seq)
        self.counters: dict[str | None, float] = {}
        self.weights: dict[str | None, float] = {}
        self.active: dict[str | None, int] = {}  # tenant -> running requests

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def __bool__(self) -> bool:
        return any(self.queues.values())

    def __contains__(self, seq: Sequence) -> bool:
        return any(entry[2] is seq for entry in self.queues.get(seq.tenant, ()))

    def set_weight(self, tenant: str | None, weight: float) -> None:
        assert weight > 0
        self.weights[tenant] = weight

    def push(self, seq: Sequence) -> None:
        tenant = seq.tenant
        if not self.queues.get(tenant) and not self.active.get(tenant):
            self._lift(tenant)
        bisect.insort(self.queues.setdefault(tenant, []), (seq.priority, seq.arrival, seq), key=_order)

    def remove(self, seq: Sequence) -> None:
        q = self.queues[seq.tenant]
        q.pop(next(i for i, entry in enumerate(q) if entry[2] is seq))

    def ordered(self) -> Iterator[Sequence]:
        """Waiting sequences in the order to admit them, as if each were admitted in turn.

        A heap over tenants keeps each step O(log tenants), so thousands of tenants stay cheap.
        """
        # (projected counter, tie-break by name, unique index so tenants never compare, tenant, head)
        heap = [(self.counters.get(t, 0.0), str(t), i, t, 0) for i, (t, q) in enumerate(self.queues.items()) if q]
        heapq.heapify(heap)
        while heap:
            projected, key, i, tenant, head = heapq.heappop(heap)
            queue = self.queues[tenant]
            seq = queue[head][2]
            yield seq
            if head + 1 < len(queue):
                cost = seq.num_prompt_tokens * PROMPT_TOKEN_COST / self.weights.get(tenant, 1.0)
                heapq.heappush(heap, (projected + cost, key, i, tenant, head + 1))

    def admitted(self, seq: Sequence) -> None:
        """`seq` left the queue to run: charge its (uncached) prompt."""
        self.remove(seq)
        self.started_running(seq)
        self.charge(seq.tenant, seq.num_pending_tokens * PROMPT_TOKEN_COST)

    def started_running(self, seq: Sequence) -> None:
        """`seq` runs: admitted, or forked from a sibling (which charged the shared prompt once)."""
        self.active[seq.tenant] = self.active.get(seq.tenant, 0) + 1

    def stopped_running(self, seq: Sequence) -> None:
        self.active[seq.tenant] -= 1
        if not self.active[seq.tenant]:
            del self.active[seq.tenant]

    def charge_output(self, seq: Sequence, tokens: int = 1) -> None:
        """Every choice's tokens count: n choices cost n times the decoding."""
        self.charge(seq.tenant, tokens * OUTPUT_TOKEN_COST)

    def charge(self, tenant: str | None, cost: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weights.get(tenant, 1.0)

    def shares(self, demands: dict[str | None, float], total: float) -> dict[str | None, float]:
        """`total` (one step's prefill budget) split between the tenants with `demands` on it by weighted
        max-min fair share: each gets its weight's part, and what a tenant needs less of goes to the
        others in the same proportions."""
        shares: dict[str | None, float] = {}
        left = total
        pending = sorted(demands, key=lambda t: demands[t] / self.weights.get(t, 1.0))
        weight = sum(self.weights.get(t, 1.0) for t in pending)
        for tenant in pending:  # smallest demand per weight first: it is the one that may leave some over
            w = self.weights.get(tenant, 1.0)
            shares[tenant] = min(demands[tenant], left * w / weight)
            left -= shares[tenant]
            weight -= w
        return shares

    def _lift(self, tenant: str | None) -> None:
        others = [self.counters.get(t, 0.0) for t in set(self.active) | {t for t, q in self.queues.items() if q}]
        if others:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(others))


def _order(entry: tuple[int, int, Sequence]) -> tuple[int, int]:
    return entry[0], entry[1]
