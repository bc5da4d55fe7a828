"""A CPU engine's adapter weights gathered through the page table, kept from one step to the next.

The torch path gathers each active adapter's pages before its matmuls (kernels.lora_pages.SlotWeights),
where unpaged slots are read in place: at decode shapes that copy cost the paged engine about a tenth of
its step. A decode step usually has the same rows with the same adapters as the step before and no load
in between, so the gathers of that step are still exact: they are kept while the device tier has loaded
nothing and the step's token slots are the same, and dropped at the first difference (their memory is
the active adapters' pages once more, at most).
"""
from __future__ import annotations

from collections.abc import Callable


class PageGathers:
    def __init__(self, loads: Callable[[], int]) -> None:
        """loads: the device tier's load count (server.engine.lora.slots.LoraSlots.loads): any change of
        what a page or an entry holds is a load."""
        self.loads = loads
        self.key: tuple | None = None
        self.gathers: dict = {}

    def for_step(self, token_slots: list[int]) -> dict:
        """The gathers a step with these token slots may reuse (a new dict when they are not valid: a step
        still running keeps its own)."""
        key = (self.loads(), tuple(token_slots))
        if key != self.key:
            self.key, self.gathers = key, {}
        return self.gathers
