"""Compile every Triton kernel variant before the engine serves, by running synthetic steps.

Triton compiles a kernel the first time it sees a new specialisation (constexpr
tile sizes, the divisibility of integer arguments, pointer alignment), which
takes seconds; without this, Llama-3-8B's ~30 variants were compiled on the
engine thread in the middle of serving. The kernels are written so that every
variant depends on the engine's configuration only (model widths, dtype,
max_lora_rank, block size), never on a step's batch (kernels.metadata), so
a handful of steps reaches them all:

- per rank tile class (kernels.lora_tiles): one step with a decode-shaped
  adapter token (gathered kernels), a run of 16 tokens and one of up to 64
  (both segmented tile heights), base-model tokens between them, prefill and
  decode attention;
- one step with a single long decode, which splits its context.

Whether the gathered shrink splits K (kernels.metadata.shrink_splits) depends on the projection's
in features alone, so the decode token of the first steps reaches the split form where there is one.

benchmarks/aot/aot_check.py checks that these steps reach every variant that the
decode, prefill, chunked and mixed batches of three real model shapes reach.
Synthetic steps write no KV (every slot is -1) and read only block 0, and the
adapter slots they name are still zero at start-up.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from kernels import metadata
from kernels.lora_tiles import lora_tiles
from kernels.metadata import GATHER_MAX_SEG_LEN, MIN_SPLIT_TOKENS, TILE_ROWS, AttentionBatch, LoraBatch
from server.engine.kernel_ops import KernelOps
from server.engine.model import CausalLM, StepContext


@dataclass(frozen=True)
class SyntheticSeq:
    context_len: int  # tokens already cached
    query_len: int  # tokens computed this step
    slot: int  # adapter slot of its tokens; -1 = base model


@dataclass(frozen=True)
class SyntheticStep:
    seqs: tuple[SyntheticSeq, ...]
    rank: int  # the active adapters' highest rank (bounds the LoRA kernels' rank loop)
    # Its LoRA as a padded decode step's tiled plan (kernels.sorted_tiles: the INDEXED segmented kernels,
    # every slot at full rank), not the eager plan; one-token sequences only.
    sorted_tiles: bool = False

    def __post_init__(self) -> None:
        if not self.seqs or any(s.query_len < 1 or s.context_len < 0 for s in self.seqs):
            raise ValueError(f"a synthetic step needs sequences with >= 1 query token, got {self.seqs}")
        if self.sorted_tiles and any(s.query_len != 1 for s in self.seqs):
            raise ValueError(f"a padded decode step's sequences have one query token each, got {self.seqs}")


def rank_classes(max_lora_rank: int, dtype: torch.dtype) -> list[int]:
    """One rank per distinct rank tile width the LoRA kernels can use up to max_lora_rank."""
    tiles = lora_tiles(dtype)
    widths = sorted({tiles.rank_block(r) for r in range(1, max_lora_rank + 1)})
    return [min(w, max_lora_rank) for w in widths]


def warmup_steps(max_lora_rank: int, max_num_batched_tokens: int, max_model_len: int,
                 dtype: torch.dtype, padded_form: str = "gathered") -> list[SyntheticStep]:
    """Steps that reach every kernel variant an engine of this configuration can launch; padded_form: its
    padded decode steps' LoRA form (kernels.metadata.PADDED_LORA_FORM), "tiled" adding a step of that plan
    (the gathered one's variants are the eager decode tokens')."""
    if padded_form not in ("gathered", "tiled"):
        raise ValueError(f"padded_form must be gathered or tiled, got {padded_form!r}")
    budget = max_num_batched_tokens - 3  # room for the three decode tokens below
    short = min(TILE_ROWS[0], budget)
    long = min(TILE_ROWS[-1], budget - short)
    context = min(8, max_model_len - 1)
    seqs = [SyntheticSeq(context, 1, 0), SyntheticSeq(context, 1, -1)]
    if short > GATHER_MAX_SEG_LEN:
        seqs += _run(short, max_model_len) + [SyntheticSeq(context, 1, -1)]
    if long > TILE_ROWS[0]:
        seqs += _run(long, max_model_len)
    steps = [SyntheticStep(tuple(seqs), rank) for rank in rank_classes(max_lora_rank, dtype)]
    long_context = min(max_model_len - 1, 4 * MIN_SPLIT_TOKENS)
    if long_context >= 2 * MIN_SPLIT_TOKENS:  # shorter contexts are never split
        steps.append(SyntheticStep((SyntheticSeq(long_context, 1, 0),), rank_classes(max_lora_rank, dtype)[0]))
    if padded_form == "tiled":
        steps.append(SyntheticStep((SyntheticSeq(context, 1, 0), SyntheticSeq(context, 1, -1)), max_lora_rank,
                                   sorted_tiles=True))
    return steps


def _run(tokens: int, max_model_len: int) -> list[SyntheticSeq]:
    """Adjacent prompts of slot 0 that form one run of `tokens`, each within max_model_len."""
    return [SyntheticSeq(0, min(max_model_len, tokens - first), 0) for first in range(0, tokens, max_model_len)]


def step_inputs(step: SyntheticStep, *, ops: KernelOps, block_size: int, lora_scratch: torch.Tensor,
                device: torch.device | str, page_table: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, StepContext, torch.Tensor]:
    """(input_ids, context, logits_indices) of a synthetic step, built the way the model runner builds them
    (page_table: the engine's, when its adapter memory is paged: the paged kernel variants)."""
    token_slots: list[int] = []
    positions: list[int] = []
    for s in step.seqs:
        token_slots += [s.slot] * s.query_len
        positions += range(s.context_len, s.context_len + s.query_len)
    tables = [[0] * -(-(s.context_len + s.query_len) // block_size) for s in step.seqs]
    attn = AttentionBatch.build(tables, [s.context_len for s in step.seqs], [s.query_len for s in step.seqs],
                                block_size, device)
    attn = dataclasses.replace(attn, slot_mapping=torch.full_like(attn.slot_mapping, -1))  # write no KV
    slots = max(token_slots) + 1
    if step.sorted_tiles:
        lora = LoraBatch.padded_tiled(token_slots, len(token_slots), slots, device, page_table)
    else:
        lora = LoraBatch.build(token_slots, device, [step.rank] * slots, page_table=page_table)
    ctx = StepContext(
        ops=ops,
        positions=torch.tensor(positions, dtype=torch.long).to(device),
        attn=attn,
        lora=lora,
        lora_scratch=lora_scratch,
    )
    ids = torch.zeros(len(token_slots), dtype=torch.long, device=device)
    return ids, ctx, torch.tensor([len(token_slots) - 1], dtype=torch.long).to(device)


def warm_up(model: CausalLM, kv_caches: list, ops: KernelOps, lora_scratch: torch.Tensor, *, block_size: int,
            max_lora_rank: int, max_num_batched_tokens: int, max_model_len: int, device: torch.device,
            page_table: torch.Tensor | None = None) -> float:
    """Run the warm-up steps; returns the seconds taken (0 when the kernels compile nothing: torch ops)."""
    if ops.name != "triton" or device.type != "cuda":
        return 0.0  # the reference ops compile nothing; the interpreter compiles nothing either
    start = time.perf_counter()
    for step in warmup_steps(max_lora_rank, max_num_batched_tokens, max_model_len, lora_scratch.dtype,
                             metadata.PADDED_LORA_FORM):
        ids, ctx, rows = step_inputs(step, ops=ops, block_size=block_size, lora_scratch=lora_scratch, device=device,
                                     page_table=page_table)
        model.forward(ids, kv_caches, ctx, rows)
    torch.cuda.synchronize(device)
    return time.perf_counter() - start
