"""vLLM's --max-cpu-loras in bytes: what one adapter of the largest rank takes on the loaded model."""
from __future__ import annotations

from adapters.format import PROJECTIONS, ModelShape


def max_adapter_bytes(shape: ModelShape, max_lora_rank: int, itemsize: int) -> int:
    """An adapter of `max_lora_rank` on all seven projections of every layer, in the serving dtype."""
    per_layer = sum(max_lora_rank * sum(shape.in_out(p)) for p in PROJECTIONS)
    return shape.num_layers * per_layer * itemsize
