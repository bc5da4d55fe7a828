"""A slot swap (evict the idle adapter, load the next) is a few batched tensor ops once the slot has
held an adapter of the same layout, not a Python-built view per module: in a storm of distinct
adapters' first uses a step swaps up to max_loras of them, and every running stream waits for that
step. The outputs stay exactly those of an engine that never swaps (eviction zeroes what the load
wrote, so a smaller adapter never reads a larger one's rows). The real engine, the tiny model."""
from __future__ import annotations

from pathlib import Path

import pytest
from torch.overrides import TorchFunctionMode

from server.engine import LLM, SamplingParams

pytestmark = pytest.mark.unit

# Evict: zero what the load wrote (1); load: A/B and scalings (2); slack for bookkeeping reads.
MAX_OPS_PER_SWAP = 6


class _CountTorchCalls(TorchFunctionMode):
    """Counts torch functions and tensor methods (views, indexing, copies) called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _outputs(llm: LLM, names: list[str], prompt: list[int]) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return {n: llm.generate([prompt], params, adapters=[n])[0].token_ids for n in names}


def test_a_slot_swap_is_a_few_batched_ops_and_outputs_stay_exact(tiny_model_dir: Path,
                                                                  tiny_adapters: dict[str, Path]) -> None:
    names = list(tiny_adapters)  # ranks 4 (q, v only), 8, 16, 32 with a rank pattern
    prompt = [5, 6, 7, 8, 9]
    reference = LLM(tiny_model_dir, device="cpu", dtype="float32", max_loras=len(names), max_lora_rank=32)
    for n in names:
        reference.add_adapter(n, tiny_adapters[n])
    expected = _outputs(reference, names, prompt)

    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_loras=1, max_lora_rank=32)
    for n in names:
        llm.add_adapter(n, tiny_adapters[n])
    slots = llm.engine.lora_slots
    swaps: list[int] = []  # torch calls of each acquire that evicted an adapter
    acquire = slots.acquire

    def counted(version, adapter):
        evictions = slots.evictions
        with _CountTorchCalls() as count:
            slot = acquire(version, adapter)
        if slots.evictions > evictions:
            swaps.append(count.calls)
        return slot

    slots.acquire = counted
    first = _outputs(llm, names, prompt)  # one slot: every adapter after the first evicts the one before
    again = _outputs(llm, names + names[:1], prompt)  # every layout has been in the slot once now
    assert first == expected and {n: again[n] for n in names} == expected
    assert len(swaps) == 2 * len(names), swaps
    later = swaps[len(names):]
    assert max(later) <= MAX_OPS_PER_SWAP, swaps
