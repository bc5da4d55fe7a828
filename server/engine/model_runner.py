"""Turns a scheduled batch into tensors, runs the model once, and samples.

All per-step metadata (positions, block tables, slot mapping, token ->
adapter slot) is built here once and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import AttentionBatch, LoraBatch
from kernels.ops import KernelOps
from server.engine.model import CausalLM, StepContext
from server.engine.sampler import SampleFailure, sample
from server.engine.scheduler import ScheduledBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    ctx: StepContext
    logits_indices: torch.Tensor  # [N]
    sampled_seqs: list[int]  # batch positions of the sequences that get a token this step


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ops: KernelOps,
        block_size: int,
        lora_scratch: torch.Tensor,  # [3, max_tokens, R]
        slot_ranks: list[int],  # live view of AdapterSlots.slot_ranks
        device: torch.device,
        seed: int,
    ) -> None:
        self.slot_ranks = slot_ranks
        self.model = model
        self.kv_caches = kv_caches
        self.ops = ops
        self.block_size = block_size
        self.lora_scratch = lora_scratch
        self.device = device
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[int] = []
        for i, (seq, n, slot) in enumerate(zip(batch.seqs, batch.num_tokens, batch.slots)):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            token_slots += [slot] * n
            context_lens.append(start)
            if start + n == len(seq.token_ids):
                logits_indices.append(len(input_ids) - 1)
                sampled.append(i)
        dev = self.device
        attn = AttentionBatch.build(
            [s.block_table for s in batch.seqs], context_lens, batch.num_tokens, self.block_size, dev
        )
        ctx = StepContext(
            ops=self.ops,
            positions=torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
            attn=attn,
            lora=LoraBatch.build(token_slots, dev, self.slot_ranks),
            lora_scratch=self.lora_scratch,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True),
            ctx=ctx,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long).to(dev, non_blocking=True),
            sampled_seqs=sampled,
        )

    def run(self, batch: ScheduledBatch) -> dict[int, int | SampleFailure]:
        """Batch position -> sampled token (or why there is none), for sequences whose pending tokens
        are all computed. An exception here is the engine's, not one request's: it ends the loop."""
        inputs = self.prepare(batch)
        logits = self.model.forward(inputs.input_ids, self.kv_caches, inputs.ctx, inputs.logits_indices)
        seqs = [batch.seqs[i] for i in inputs.sampled_seqs]
        tokens = sample(logits, [s.params for s in seqs], [s.num_output_tokens for s in seqs], self.generator)
        return dict(zip(inputs.sampled_seqs, tokens))
