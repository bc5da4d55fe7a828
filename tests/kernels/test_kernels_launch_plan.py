"""Per-step launch plans: the programs a step launches are the work it has (kernels.metadata).

The captured mixed batch is Llama-3-8B's: a 1793-token chunk continuing a 2000-token prefix next to
255 decodes over 8 adapters and the base model (2048 tokens, benchmarks.aot.aot_shapes.mixed_batch).
Launches are captured through the real entry points on meta activations (nothing runs) with the
step's metadata on the CPU, so every program of every grid can be checked against its work list.
"""
from __future__ import annotations

import math

import pytest
import torch

from benchmarks.aot import aot
from benchmarks.aot.aot_shapes import mixed_batch
from kernels import attention_triton, lora_triton
from kernels.metadata import GATHER_MAX_SEG_LEN, TILE_ROWS, AttentionBatch, LoraBatch, attention_plan, lora_work, pack_int32, runs

pytestmark = pytest.mark.unit

HIDDEN, Q, KV, INTER, HEADS, KV_HEADS = 4096, 4096, 1024, 14336, 32, 8
GROUPS = {"qkv": (HIDDEN, (Q, KV, KV)), "o": (Q, (HIDDEN,)), "gate_up": (HIDDEN, (INTER, INTER)),
          "down": (INTER, (HIDDEN,))}


def mixed_token_slots() -> list[int]:
    return [s.slot for s in mixed_batch() for _ in range(s.query_len)]


def capture_lora_layer(batch: LoraBatch, rank: int = 16) -> list[aot.Launch]:
    """One decoder layer's LoRA launches at Llama-3-8B widths, bf16 slot buffers at max rank 64."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    tokens = batch.num_tokens
    with aot.capture() as launches:
        for in_f, outs in GROUPS.values():
            a = torch.empty(len(outs), 8, 64, in_f, **meta)
            b = tuple(torch.empty(8, 64, n, **meta).transpose(1, 2) for n in outs)
            h = torch.empty(len(outs), tokens, 64, **meta)
            lora_triton.lora_shrink(torch.empty(tokens, in_f, **meta), a, batch, torch.empty(len(outs), 8), h)
            offsets = tuple(sum(outs[:i]) for i in range(len(outs)))
            lora_triton.lora_expand(h, b, batch, torch.empty(tokens, sum(outs), **meta), offsets)
    assert all(launch.name.endswith(("shrink_kernel", "expand_kernel")) for launch in launches)
    return launches


def programs(launch: aot.Launch) -> tuple[int, int]:
    """(programs, empty programs) of one captured LoRA launch: a program is empty when its work-list
    entry is a base-model or empty run, its rank tile is past R, or its column tile past its slice."""
    args = dict(zip(launch.kernel.arg_names, launch.args)) | launch.kwargs
    work = args.get("gather_ptr", args.get("tiles_ptr"))
    assert work.shape[0] == launch.grid[0]
    slot_col = 1 if "gather_ptr" in args else 2
    dead = work[:, slot_col] < 0
    if "tiles_ptr" in args:
        dead |= work[:, 1] <= 0
    dead_entries = int(dead.sum())
    live_entries = launch.grid[0] - dead_entries
    if "shrink" in launch.name:
        _, slices, r_tiles = launch.grid
        empty_r = sum(r * args["BLOCK_R"] >= args["R"] for r in range(r_tiles))
        return math.prod(launch.grid), (dead_entries * r_tiles + live_entries * empty_r) * slices
    widths, (nb0, nb1) = (args["n0"], args["n1"], args["n2"]), (args["nb0"], args["nb1"])
    empty_c = 0
    for c in range(launch.grid[1]):
        sl = (c >= nb0) + (c >= nb0 + nb1)
        n_blk = c - (0, nb0, nb0 + nb1)[sl]
        empty_c += n_blk * args["BLOCK_N"] >= widths[sl]
    return math.prod(launch.grid), dead_entries * launch.grid[1] + live_entries * empty_c


def test_mixed_batch_launches_few_empty_programs() -> None:
    batch = LoraBatch.build(mixed_token_slots(), "cpu", [16] * 8)
    launches = capture_lora_layer(batch)
    total, empty = map(sum, zip(*(programs(launch) for launch in launches)))
    assert empty / total < 0.25, (empty, total)
    # The uniform launch it replaces: (runs x the longest run's 64-row tiles) programs per slice and
    # column tile, of which only an adapter run's own tiles had work: 96% empty or more.
    starts, lens, slots = runs(mixed_token_slots())
    tiles = math.ceil(max(lens) / 64)
    useful_tiles = sum(math.ceil(n / 64) for n, s in zip(lens, slots) if s >= 0)
    uniform = sum(len(lens) * tiles * len(outs) * (1 + math.ceil(max(outs) / 128)) for _, outs in GROUPS.values())
    useful = sum(useful_tiles * (len(outs) + sum(math.ceil(n / 128) for n in outs)) for _, outs in GROUPS.values())
    assert 1 - useful / uniform > 0.9


def test_the_plan_lists_each_adapter_token_once() -> None:
    slots = mixed_token_slots()
    batch = LoraBatch.build(slots, "cpu", [16] * 8)
    plan = batch.plan
    covered = [t for t, _ in plan.gather.tolist()]
    for rows in TILE_ROWS:
        for first, n, slot, _ in plan.tiles[rows].tolist():
            assert 1 <= n <= rows and all(slots[t] == slot for t in range(first, first + n))
            covered += range(first, first + n)
    assert sorted(covered) == [t for t, s in enumerate(slots) if s >= 0]
    assert all(slots[t] == s for t, s in plan.gather.tolist())
    starts, lens, run_slots = runs(slots)
    short = sum(n for n, s in zip(lens, run_slots) if s >= 0 and n <= GATHER_MAX_SEG_LEN)
    assert plan.num_gather == short
    assert plan.num_tiles(64) == 1793 // 64 and plan.num_tiles(16) == 1  # the chunk: 28 full tiles, 1 row left


def test_launch_grids_are_the_plan() -> None:
    batch = LoraBatch.build(mixed_token_slots(), "cpu", [16] * 8)
    launches = capture_lora_layer(batch)
    by_work = {}
    for launch in launches:
        args = dict(zip(launch.kernel.arg_names, launch.args))
        work = args.get("gather_ptr", args.get("tiles_ptr"))
        by_work.setdefault(launch.name, set()).add((work.shape[0], launch.grid[0]))
    assert all(n == g for pairs in by_work.values() for n, g in pairs)
    assert by_work["_bgmv_shrink_kernel"] == {(batch.plan.num_gather, batch.plan.num_gather)}


def test_packed_sections_are_16_byte_aligned() -> None:
    """Triton specialises on pointer alignment: a section's offset must not depend on the batch."""
    views = pack_int32([[1, 2, 3], [], [4] * 5, [7]], "meta")
    assert [v.data_ptr() % 16 for v in views] == [0, 0, 0, 0]
    assert [v.numel() for v in views] == [3, 0, 5, 1]
    gather, tiles = lora_work([0, 3, 70], [3, 67, 2], [5, -1, 6], GATHER_MAX_SEG_LEN)
    assert gather == [0, 5, 1, 5, 2, 5, 70, 6, 71, 6] and tiles == {16: [], 64: []}


def test_mixed_attention_launches_no_empty_programs() -> None:
    seqs = mixed_batch()
    batch = AttentionBatch.build([[0] * math.ceil((s.context_len + s.query_len) / 16) for s in seqs],
                                 [s.context_len for s in seqs], [s.query_len for s in seqs], 16)
    block_q = attention_triton.PREFILL_BLOCK_M // (HEADS // KV_HEADS)
    plan = attention_plan(batch.query_lens_host, batch.seq_lens_host, block_q, KV_HEADS, attention_triton.BLOCK_N,
                          "cpu")
    assert plan.num_prefill_tiles == math.ceil(1793 / block_q) and plan.num_decode == 255
    assert plan.num_splits == 1  # 255 x 8 programs fill the GPU: no split
    # Before: (sequences x the longest query's tiles x kv heads) programs, 98.7% of which exited at once.
    assert (plan.num_prefill_tiles + plan.num_decode) / (256 * plan.num_prefill_tiles) < 0.02


def test_split_decode_programs_past_a_short_context_are_few() -> None:
    lens = (4096, 3000, 2048, 4000)
    plan = attention_plan((1,) * 4, lens, 16, KV_HEADS, 32, "cpu")
    assert plan.num_splits >= 2
    empty = sum(plan.num_splits - math.ceil(n / plan.split_len) for n in lens)
    assert empty / (4 * plan.num_splits) < 0.25
