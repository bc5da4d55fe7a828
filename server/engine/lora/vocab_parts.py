"""Adapters' parts of embed_tokens and lm_head on the device, per slot, and how a step applies them.

What the parts are, and PEFT's semantics for each, is adapters.vocab_format's. They live beside the
slots' LoRA buffers (server.engine.lora.slots), not in them: a slot's buffers are sized for the
decoder's projections, and a full embedding is a thousand times a rank-8 slot. A part enters with its
adapter's slot and leaves with it (LoraSlots calls load and evict). A full copy equal to the base's (PEFT
writes the base's embedding and lm_head beside any LoRA on them) is dropped: on a CPU as the host tier
takes the adapter (`prepare`, on its loader threads), so host memory does not hold it either; on CUDA,
whose host tier has no such hook, as it enters its slot.

Per step, only the rows of requests whose slot has parts change: the embedding rows of their tokens and
the logits rows they sample from, so a request on another adapter or the base is unaffected. Steps with
such rows run eager, unpadded (ModelRunner): a padded decode step's slots are a bound, not the data.
"""
from __future__ import annotations

import dataclasses

import torch

from adapters.packed import PackedLoraAdapter
from adapters.vocab_format import VocabLora, VocabWeights
from kernels.metadata import LoraBatch


class VocabParts:
    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor | None, max_loras: int) -> None:
        """embed: the base's [V, H]; lm_head: its float [V, H] (the embedding where tied), None where it is
        quantized (a copy is then never equal to it)."""
        self.embed_weight = embed
        self.lm_head_weight = lm_head
        self.parts: dict[int, VocabWeights] = {}
        # Whether each slot's adapter has parts: a live view for ModelRunner (no padded decode over them).
        self.slot_has = [False] * max_loras

    @classmethod
    def of_model(cls, model, max_loras: int) -> "VocabParts":
        """For a CausalLM (server.engine.model)."""
        lm_head = model.lm_head if isinstance(model.lm_head, torch.Tensor) else None
        return cls(model.embed, lm_head, max_loras)

    @property
    def bytes_used(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    def prepare(self, adapter: PackedLoraAdapter) -> PackedLoraAdapter:
        """The host tier's hook (its loader threads): `adapter` without the full copies that equal the base's
        modules, its size_bytes less theirs."""
        v = adapter.vocab
        if v is None:
            return adapter

        def same(copy: torch.Tensor | None, base: torch.Tensor | None) -> bool:
            return (copy is not None and base is not None and copy.dtype == base.dtype
                    and torch.equal(copy.to(base.device), base))

        drop = {name: same(getattr(v, name), base) for name, base in (("embed", self.embed_weight),
                                                                       ("lm_head", self.lm_head_weight))}
        if not any(drop.values()):
            return adapter
        freed = sum(getattr(v, name).nbytes for name, dropped in drop.items() if dropped)
        kept = dataclasses.replace(v, **{name: None for name, dropped in drop.items() if dropped})
        return dataclasses.replace(adapter, vocab=kept, size_bytes=adapter.size_bytes - freed)

    def load(self, slot: int, adapter: PackedLoraAdapter) -> None:
        if adapter.vocab is None:
            return
        device = self.embed_weight.device

        def to(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        def lora(p: VocabLora | None) -> VocabLora | None:
            return None if p is None else VocabLora(to(p.a), to(p.b), p.scaling)

        v = self.prepare(adapter).vocab  # a no-op where the host tier ran it
        self.parts[slot] = VocabWeights(lora(v.embed_lora), lora(v.lm_head_lora), to(v.embed), to(v.lm_head))
        self.slot_has[slot] = True

    def evict(self, slot: int) -> None:
        self.parts.pop(slot, None)
        self.slot_has[slot] = False

    def active(self, lora: LoraBatch) -> list[int]:
        """The step's slots that have parts (none in a padded step: ModelRunner keeps those out of one)."""
        return [] if lora.padded else [s for s in lora.active_slots if s in self.parts]

    def embed(self, h: torch.Tensor, input_ids: torch.Tensor, lora: LoraBatch, slots: list[int],
              scale: float | None) -> None:
        """h [T, H]: the base's embeddings (times `scale`), rewritten in place for the tokens of `slots`."""
        for slot in slots:
            v = self.parts[slot]
            if v.embed is None and v.embed_lora is None:
                continue
            rows = (lora.token_slots == slot).nonzero().squeeze(1)  # [t]
            ids = input_ids.index_select(0, rows)
            x = v.embed.index_select(0, ids) if v.embed is not None else h.index_select(0, rows)
            if v.embed is not None and scale is not None:
                x = x * scale
            if v.embed_lora is not None:  # PEFT: (A^T[ids] @ B^T) * scaling, times the embedding scale
                delta = v.embed_lora.a.t().index_select(0, ids) @ v.embed_lora.b.t() * v.embed_lora.scaling
                x = x + (delta * scale if scale is not None else delta)
            h.index_copy_(0, rows, x)

    def logits(self, logits: torch.Tensor, h: torch.Tensor, lora: LoraBatch, logits_indices: torch.Tensor,
               slots: list[int]) -> None:
        """logits [N, V] of the normed rows h [N, H] (token positions logits_indices), rewritten in place for
        the rows of `slots`: before any soft-capping, as PEFT's lm_head is."""
        row_slots = lora.token_slots.index_select(0, logits_indices)  # [N]
        for slot in slots:
            v = self.parts[slot]
            if v.lm_head is None and v.lm_head_lora is None:
                continue
            rows = (row_slots == slot).nonzero().squeeze(1)  # [n]
            x = h.index_select(0, rows)
            out = x @ v.lm_head.t() if v.lm_head is not None else logits.index_select(0, rows)
            if v.lm_head_lora is not None:  # PEFT's Linear: base(x) + B(A(x)) * scaling
                out = out + (x @ v.lm_head_lora.a.t()) @ v.lm_head_lora.b.t() * v.lm_head_lora.scaling
            logits.index_copy_(0, rows, out.to(logits.dtype))
