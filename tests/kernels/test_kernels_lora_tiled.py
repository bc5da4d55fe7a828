"""The tiled (token-grouped) form of a padded decode step's LoRA (kernels.sorted_tiles): rows sorted by slot
into tiles of the segmented kernels, which read each tile's rows through the sorted order (INDEXED).

The plan on the host (every adapter row once, tiles of one slot and at most TILE rows, a table of the
bucket's size); the kernels against kernels.lora_ref and the dense per-adapter oracle under
TRITON_INTERPRET=1 (real launches with a GPU) for unsorted, repeated, -1, all-one and all-different slots at
mixed ranks, split-K or not; no rank row read past a slot's own rank; and the same grids and scalar
arguments for two batches of one bucket (what a captured CUDA graph replays)."""
from __future__ import annotations

import random

import pytest
import torch

from benchmarks.aot import aot
from kernels import lora_ref, lora_triton, metadata
from kernels.metadata import LoraBatch
from kernels.sorted_tiles import FIELDS, TILE, device_tables, max_tiles, sorted_tiles
from tests.kernel_helpers import bit_equal
from tests.kernels.test_kernels_lora import TOL, make_problem, run_and_check

NUM_SLOTS = 6
CASES = {
    "unsorted": [3, 0, 5, 0, 3, 1, 0, 3],
    "base-rows": [2, -1, 0, -1, -1, 2, 1, -1, 0],
    "one-slot": [4] * 21,  # a full tile and a partial one
    "all-different": [5, 4, 3, 2, 1, 0],
    "all-base": [-1, -1, -1],
    "random": [random.Random("tiled").choice([-1, 0, 1, 2, 3, 4, 5]) for _ in range(40)],
}


def tiled_batch(slots: list[int], device, rows: int | None = None) -> LoraBatch:
    """A padded decode batch of `rows` rows (default: the slots'; the rest padding) on the tiled plan."""
    return LoraBatch.padded_tiled(slots, rows or len(slots), NUM_SLOTS, device)


@pytest.mark.parametrize("slots", list(CASES.values()), ids=list(CASES))
def test_the_plan_takes_every_adapter_row_once_in_tiles_of_one_slot(slots: list[int]) -> None:
    rows = len(slots) + 3
    plan = sorted_tiles(slots, rows, NUM_SLOTS)
    assert len(plan.tiles) == FIELDS * max_tiles(rows, NUM_SLOTS) and len(plan.order) == rows
    taken = []
    entries = [plan.tiles[i: i + FIELDS] for i in range(0, len(plan.tiles), FIELDS)]
    used = [e for e in entries if e[2] >= 0]
    assert all(e == [0, 0, -1, 0] for e in entries[len(used):]), "unused entries come last, slot -1"
    for first, n, slot, zero in used:
        assert 1 <= n <= TILE and zero == 0
        tile_rows = plan.order[first: first + n]
        assert {slots[r] for r in tile_rows} == {slot}
        taken += tile_rows
    assert sorted(taken) == [r for r, s in enumerate(slots) if s >= 0]
    assert [slots[r] for r in taken] == sorted(slots[r] for r in taken)  # sorted by slot
    # Per slot at most one partial tile: the bound max_tiles is built on.
    for slot in set(slots) - {-1}:
        assert sum(1 for _, n, s, _ in used if s == slot and n < TILE) <= 1


def test_max_tiles_bounds_every_assignment() -> None:
    rng = random.Random("bound")
    for _ in range(200):
        rows, slots = rng.randint(1, 80), rng.randint(1, 70)
        assignment = [rng.randrange(-1, slots) for _ in range(rng.randint(0, rows))]
        plan = sorted_tiles(assignment, rows, slots)  # asserts the table holds it
        assert len(plan.tiles) == FIELDS * max_tiles(rows, slots)
    assert max_tiles(64, 64) == 4 + 64 and max_tiles(256, 8) == 16 + 8 and max_tiles(1, 64) == 2


def _entry(kernel, batch: LoraBatch):
    """A lora_triton entry (shrink or expand) run on `batch` whatever batch it is given (run_and_check
    passes an eager one)."""
    def run(*args):
        args = list(args)
        args[2] = batch
        kernel(*args)
    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("slots", list(CASES.values()), ids=list(CASES))
def test_indexed_tiles_equal_the_reference(slots: list[int], dtype: torch.dtype, kernel_device) -> None:
    """make_problem's slots have ranks 16, 8 and 4 of max 16: ranks below the max share a launch."""
    p = make_problem(slots, hidden=96, max_rank=16, widths=[40, 20, 20], dtype=dtype, num_slots=NUM_SLOTS)
    batch = tiled_batch(slots, kernel_device)
    assert batch.plan.num_gather == 0 and batch.plan.order is not None
    run_and_check(p, slots, _entry(lora_triton.lora_shrink, batch), _entry(lora_triton.lora_expand, batch),
                  kernel_device)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("slots", [CASES["base-rows"], CASES["random"]], ids=["base-rows", "random"])
def test_indexed_tiles_apply_split_or_not(slots: list[int], splits: int, kernel_device) -> None:
    """lora_apply on the tiled plan: split-K partials by token row, summed in split order; -1 and padding
    rows (4 past the step's) bit-identical; the same bits on a second run."""
    p = make_problem(slots, hidden=300, max_rank=16, widths=[24, 16], dtype=torch.float32, num_slots=NUM_SLOTS)
    rows = len(slots) + 4
    x = torch.cat([p.x, torch.randn(4, p.x.shape[1])])
    y0 = torch.randn(rows, p.y_width, generator=torch.Generator().manual_seed(3))
    want = y0.clone()
    h_ref = torch.zeros(2, len(slots), 16)
    lora_ref.lora_shrink(p.x, p.lora_a, p.batch, p.scaling, h_ref)
    lora_ref.lora_expand(h_ref, p.lora_b, p.batch, want[: len(slots)], p.offsets)

    def apply() -> torch.Tensor:
        y = y0.to(kernel_device, copy=True)
        h = torch.full((2, rows, 16), float("nan"), device=kernel_device)
        lora_triton.lora_apply(x.to(kernel_device), p.lora_a.to(kernel_device),
                               tuple(b.to(kernel_device) for b in p.lora_b), p.scaling.to(kernel_device), p.offsets,
                               tiled_batch(slots, kernel_device, rows), h, y, splits=splits)
        return y.cpu()

    got = apply()
    off = torch.tensor([s < 0 for s in slots] + [True] * 4)
    assert bit_equal(got[off], y0[off]), "a base-model or padding row changed"
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert bit_equal(got, apply()), "two runs differ"


def _launches(batch: LoraBatch, rows: int, splits: int | None) -> list[tuple]:
    """Every launch of a qkv-shaped apply on meta activations: (kernel, grid, scalar arguments, tensor
    shapes and strides and, for the integer ones (the plan), their addresses)."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    a = torch.empty(3, NUM_SLOTS, 16, 1024, **meta)
    b = tuple(torch.empty(NUM_SLOTS, n, 16, **meta) for n in (64, 16, 16))
    with aot.capture() as launches:
        lora_triton.lora_apply(torch.empty(rows, 1024, **meta), a, b, torch.empty(3, NUM_SLOTS, device="meta"),
                               (0, 64, 80), batch, torch.empty(3, rows, 16, **meta),
                               torch.empty(rows, 96, **meta), splits=splits)
    return [(launch.name, launch.grid, tuple(sorted(launch.kwargs.items())),
             tuple((tuple(x.shape), x.stride(), None if x.is_floating_point() else x.data_ptr())
                   if isinstance(x, torch.Tensor) else x for x in launch.args)) for launch in launches]


@pytest.mark.parametrize("splits", [1, None], ids=["unsplit", "plan-split"])
def test_two_batches_of_one_bucket_launch_the_same(splits, monkeypatch) -> None:
    """Persistent plan buffers refilled in place (as the engine's decode buffers are): two different steps
    padded to bucket 24 launch the same grids (the table's fixed size) and scalar arguments, and read their
    plan from the same addresses; split-K (lowered MIN_SPLIT_K) with the same count."""
    monkeypatch.setattr(metadata, "MIN_SPLIT_K", 256)
    rows = 24
    tiles = torch.zeros(max_tiles(rows, NUM_SLOTS), FIELDS, dtype=torch.int32)
    order = torch.zeros(rows, dtype=torch.int32)
    token_slots = torch.zeros(rows, dtype=torch.int32)
    gather = torch.zeros(rows, 2, dtype=torch.int32)
    batch = LoraBatch.padded_decode(token_slots, gather, NUM_SLOTS, tiled_plan=(tiles, order))
    seen = []
    for slots in ([0] * 20, [5, -1, 3, 2, 1, 0, 4, 4, 4, 4, -1]):  # 2 tiles; 7 tiles and 13 padding rows
        new_tiles, new_order = device_tables(sorted_tiles(slots, rows, NUM_SLOTS), "cpu")
        tiles.copy_(new_tiles)
        order.copy_(new_order)
        token_slots.copy_(torch.tensor(slots + [-1] * (rows - len(slots)), dtype=torch.int32))
        seen.append(_launches(batch, rows, splits))
    assert seen[0] == seen[1]
    names = [name for name, *_ in seen[0]]
    assert names == ["_sgmv_shrink_kernel", "_sgmv_expand_kernel"]
    assert all(grid[0] == max_tiles(rows, NUM_SLOTS) == 2 + 6 for _, grid, *_ in seen[0])
    shrink_kw = dict(seen[0][0][2])
    assert shrink_kw["INDEXED"] and shrink_kw["BLOCK_M"] == TILE and shrink_kw["SPLIT"] == (splits is None)


@pytest.mark.parametrize("splits", [1, 2])
def test_indexed_tiles_stop_at_each_slots_own_rank(splits: int, kernel_device) -> None:
    """With the slots' rank table (as the engine's padded steps pass it), the tiled kernels read no rank row
    past a slot's own, as the gathered ones: rows there hold NaN here (the slot pool keeps them zero) and
    the result is still the reference's; a free slot (rank 0) in a row's place reads nothing at all."""
    slots = [1, 0, 2, 1, -1, 1, 0, 3]
    ranks = [4, 20, 8, 0]
    g = torch.Generator().manual_seed(2)
    max_rank, hidden, outs = 32, 300, (24, 8)
    a = torch.randn(len(outs), len(ranks), max_rank, hidden, generator=g)
    b = tuple(torch.randn(len(ranks), n, max_rank, generator=g) for n in outs)
    for s, r in enumerate(ranks):
        a[:, s, r:] = 0
        for bi in b:
            bi[s, :, r:] = 0
    scaling = torch.rand(len(outs), len(ranks), generator=g)
    x = torch.randn(len(slots), hidden, generator=g)
    want = torch.ones(len(slots), sum(outs))
    h_ref = torch.zeros(len(outs), len(slots), max_rank)
    ref_batch = LoraBatch.build(slots)
    lora_ref.lora_shrink(x, a, ref_batch, scaling, h_ref)
    lora_ref.lora_expand(h_ref, b, ref_batch, want, (0, outs[0]))
    poisoned_a, poisoned_b = a.clone(), tuple(bi.clone() for bi in b)
    for s, r in enumerate(ranks):
        poisoned_a[:, s, r:] = float("nan")
        for bi in poisoned_b:
            bi[s, :, r:] = float("nan")
    dev = kernel_device
    table = torch.tensor(ranks, dtype=torch.int32, device=dev)
    batch = LoraBatch.padded_tiled(slots, len(slots), len(ranks), dev, slot_rank_table=table)
    y = torch.ones(len(slots), sum(outs), device=dev)
    h = torch.zeros(len(outs), len(slots), max_rank, device=dev)
    lora_triton.lora_apply(x.to(dev), poisoned_a.to(dev), tuple(bi.to(dev) for bi in poisoned_b), scaling.to(dev),
                           (0, outs[0]), batch, h, y, splits=splits)
    torch.testing.assert_close(y.cpu(), want, **TOL[torch.float32])
