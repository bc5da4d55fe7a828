"""An adapter's weights in one flat host buffer, in the serving dtype, for the host tier.

Parsing validates weights in float32 (adapters.format); the host tier then
keeps them as the engine will use them: in its dtype (a rank-8 Llama-3-8B
adapter is 84 MB in float32, 42 MB in bf16), page-locked on CUDA hosts so
copies to the device run asynchronously, and contiguous, so filling a slot is
a few large copies instead of one per tensor (~670 for Llama-3-8B).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

import torch

from adapters.format import LoraAdapter, LoraWeights


@dataclass(frozen=True, eq=False)
class PackedLoraAdapter(LoraAdapter):
    """A LoraAdapter whose every A and B is a view of `flat`; size_bytes counts the buffer itself.

    Module k of `weights` (in its order) has A [r, in] at flat[offsets[2k]:] and B^T [r, out]
    (rank-major, as the device slots hold B) right after it at flat[offsets[2k+1]:]; both contiguous.
    """

    flat: torch.Tensor  # [numel] serving dtype, pinned on CUDA hosts
    scalings: torch.Tensor  # [num_modules] float32, pinned alike
    # [sum of the DoRA modules' out_features] float32, pinned alike: their magnitude vectors, in module
    # order (each module's LoraWeights.magnitude is a view); empty for plain LoRA. Float32 whatever the
    # serving dtype: the engine divides it by a weight norm it computes in float32 (dora_scales).
    magnitudes: torch.Tensor
    offsets: tuple[int, ...]  # start of each module's A, then of its B^T, in `flat`
    module_numel: tuple[int, ...]  # elements of each module's A plus B
    # The host tier replaced each magnitude m in `magnitudes` by its DoRA scale m / ||W + s B A|| against the
    # engine's base weights (server.engine.lora.slots.LoraSlots.prepare): a slot load then copies them.
    magnitudes_are_scales: bool = False

    def tensors(self) -> list[torch.Tensor]:
        """Per module, in order: A [r, in] and B^T [r, out], views of `flat`, contiguous. Built once (a
        slot load reads them every time the adapter enters a slot); not to be changed by the caller."""
        return self._tensors

    @cached_property
    def _tensors(self) -> list[torch.Tensor]:
        return [t for w in self.weights.values() for t in (w.a, w.b.t())]

    @cached_property
    def scaling_entries(self) -> list[torch.Tensor]:
        """`scalings` as one 0-d view per module, in order (a slot load's copy sources)."""
        return list(self.scalings.unbind())

    @cached_property
    def layout(self) -> tuple[tuple[tuple[int, str], int], ...]:
        """((layer, projection), rank) per module, in order: which rows of a slot a load writes."""
        return tuple((key, w.a.shape[0]) for key, w in self.weights.items())

    def extent(self, first: int, last: int) -> tuple[int, int]:
        """The span [lo, hi) of `flat` that modules [first, last) occupy."""
        return self.offsets[2 * first], self.offsets[2 * last - 2] + self.module_numel[last - 1]

    def spans(self, limit: int) -> list[tuple[int, int]]:
        """Module ranges [first, last) whose A and B together are at most `limit` elements (one module
        above it stands alone), so a fixed staging buffer can take them one range at a time."""
        ranges, first, size = [], 0, 0
        for k, n in enumerate(self.module_numel):
            if size and size + n > limit:
                ranges.append((first, k))
                first, size = k, 0
            size += n
        if first < len(self.module_numel):
            ranges.append((first, len(self.module_numel)))
        return ranges


def pack_adapter(adapter: LoraAdapter, dtype: torch.dtype, pin: bool) -> PackedLoraAdapter:
    """Copy `adapter`'s weights into one buffer of `dtype` (cast once, as the slot copy did before)."""
    weights = list(adapter.weights.items())
    sizes = [w.a.numel() + w.b.numel() for _, w in weights]
    flat = torch.empty(sum(sizes), dtype=dtype, pin_memory=pin)
    scalings = torch.tensor([w.scaling for _, w in weights], dtype=torch.float32)
    magnitudes = torch.cat([torch.zeros(0)] + [w.magnitude for _, w in weights if w.magnitude is not None])
    # Its draft LoRA packed alike: it enters the draft model's slot with the adapter (server.engine.lora.draft_slots).
    draft = pack_adapter(adapter.draft, dtype, pin) if adapter.draft is not None else None
    vocab = adapter.vocab.cast(dtype, pin) if adapter.vocab is not None else None  # beside `flat`: a slot's
    # LoRA buffers do not hold them (server.engine.lora.vocab_parts does)
    if pin:
        scalings = scalings.pin_memory()
        magnitudes = magnitudes.pin_memory()
    at_magnitude = 0
    views: dict = {}
    offsets, at = [], 0
    for (key, w), size in zip(weights, sizes):
        rank, out = w.b.shape[1], w.b.shape[0]
        a = flat[at: at + w.a.numel()].view(w.a.shape)
        b_t = flat[at + w.a.numel(): at + size].view(rank, out)
        a.copy_(w.a)
        b_t.copy_(w.b.t())
        magnitude = None
        if w.magnitude is not None:
            magnitude = magnitudes[at_magnitude: at_magnitude + w.magnitude.numel()]
            at_magnitude += w.magnitude.numel()
        views[key] = LoraWeights(a, b_t.t(), w.scaling, magnitude)
        offsets += (at, at + w.a.numel())
        at += size
    return PackedLoraAdapter(
        rank=adapter.rank,
        target_modules=adapter.target_modules,
        use_rslora=adapter.use_rslora,
        weights=MappingProxyType(views),
        size_bytes=(flat.numel() * flat.element_size() + magnitudes.numel() * magnitudes.element_size()
                    + (vocab.nbytes if vocab is not None else 0)
                    + (adapter.medusa.nbytes if adapter.medusa is not None else 0)
                    + (draft.size_bytes if draft is not None else 0)),
        config=adapter.config,
        vocab=vocab,
        medusa=adapter.medusa,
        draft=draft,
        flat=flat,
        scalings=scalings,
        magnitudes=magnitudes,
        offsets=tuple(offsets),
        module_numel=tuple(sizes),
    )
