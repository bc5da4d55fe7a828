"""The shrinks' split-K form (issue 21): K split over programs into fp32 partials that the expand
sums in a fixed order. Against kernels.lora_ref under TRITON_INTERPRET=1 (real launches with a GPU):
mixed ranks, free slots, one adapter over a long run (gathered in a padded decode batch, tiled in an
eager step) and many adapters, fused q/k/v slices, 1, 2 and 4 splits; the same bits on every run; and
the split counts the launch plan picks from the shape."""
from __future__ import annotations

import random

import pytest
import torch

from kernels import lora_ref, lora_triton, metadata
from kernels.metadata import MAX_SHRINK_SPLITS, MIN_SPLIT_K, LoraBatch, shrink_splits
from tests.kernel_helpers import bit_equal
from tests.kernels.test_kernels_lora import TOL, make_problem, request_slots, token_slots


def test_the_plan_splits_big_in_features_by_the_programs_it_has() -> None:
    assert shrink_splits(2 * MIN_SPLIT_K - 1, 1) == 1  # small K: unsplit whatever the batch
    assert shrink_splits(64, 1) == 1
    # Llama-3-8B at rank 16: qkv (3 slices) and down (K = 14336, 1 slice) by decode bucket.
    assert [shrink_splits(4096, rows * 3) for rows in (1, 8, 64, 256)] == [8, 8, 2, 2]
    assert [shrink_splits(14336, rows) for rows in (1, 64, 128, 512)] == [8, 8, 4, 2]
    assert shrink_splits(1024, 1) == 2  # at most K // MIN_SPLIT_K
    assert all(shrink_splits(k, p) in (1, 2, 4, 8) for k in (100, 1000, 5000, 30000) for p in (1, 7, 100, 5000))
    assert MAX_SHRINK_SPLITS == 8


def padded(slots: list[int], device) -> LoraBatch:
    """A padded decode batch over these rows (every row gathered, -1 rows exit), as the engine builds."""
    rows = torch.tensor(slots, dtype=torch.int32, device=device)
    gather = torch.stack([torch.arange(len(slots), dtype=torch.int32, device=device), rows], 1)
    return LoraBatch.padded_decode(rows, gather.contiguous(), num_slots=max(slots) + 1)


def apply(p, batch: LoraBatch, splits: int, device, y0: torch.Tensor) -> torch.Tensor:
    num_slices, _, rank, _ = p.lora_a.shape
    h = torch.full((num_slices, batch.num_tokens, rank), float("nan"), dtype=p.x.dtype, device=device)
    y = y0.to(device, copy=True)
    lora_triton.lora_apply(p.x.to(device), p.lora_a.to(device), tuple(b.to(device) for b in p.lora_b),
                           p.scaling.to(device), p.offsets, batch, h, y, splits=splits)
    return y.cpu()


def check(slots: list[int], splits: int, device, *, hidden: int = 300, widths=(40, 20, 20), rank: int = 16,
          num_slots: int = 6, dtype=torch.float32, form: str = "padded") -> None:
    p = make_problem(slots, hidden=hidden, max_rank=rank, widths=list(widths), dtype=dtype, num_slots=num_slots)
    batch = padded(slots, device) if form == "padded" else LoraBatch.build(slots, device)
    assert form != "padded" or batch.plan.num_gather == len(slots)
    y0 = torch.randn(len(slots), p.y_width, generator=torch.Generator().manual_seed(3)).to(dtype)
    y0[0, 0] = float("nan")  # outside every slice: must survive
    want = y0.clone()
    h = torch.zeros(len(widths), len(slots), rank)  # fp32: the split form never rounds its partials
    lora_ref.lora_shrink(p.x, p.lora_a, p.batch, p.scaling, h)
    lora_ref.lora_expand(h, p.lora_b, p.batch, want, p.offsets)
    got = apply(p, batch, splits, device, y0)
    base = torch.tensor([s < 0 for s in slots])
    assert bit_equal(got[base], y0[base]), "a row of slot -1 changed"
    covered = torch.zeros(p.y_width, dtype=torch.bool)
    for off, n in zip(p.offsets, widths):
        covered[off: off + n] = True
    assert bit_equal(got[:, ~covered], y0[:, ~covered]), "wrote outside the slices"
    torch.testing.assert_close(got.float(), want.float(), equal_nan=True, **TOL[dtype])
    again = apply(p, padded(slots, device) if form == "padded" else LoraBatch.build(slots, device), splits,
                  device, y0)
    assert bit_equal(got, again), "two runs differ"


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_mixed_ranks_free_slots_and_fused_qkv(splits: int, kernel_device) -> None:
    """Slots of ranks 16, 8, 4 (make_problem), -1 rows between them, slots 4 and 5 never used; K = 300 so
    the last of 4 splits of 128-feature chunks has nothing to read (it writes zeros)."""
    check([0, -1, 2, 1, 1, -1, 3, 0], splits, kernel_device)


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("form", ["padded", "build"])
def test_one_adapter_over_a_long_run(form: str, splits: int, kernel_device) -> None:
    """24 rows, 21 of one adapter (rank 8 of 16): a padded decode batch gathers every row, an eager
    step tiles the run (16 + 16-row tiles: the segmented kernels' split form)."""
    slots = [1] * 21 + [-1] * 3
    if form == "build":
        assert LoraBatch.build(slots).plan.num_gather == 0
    check(slots, splits, kernel_device, widths=(24,), num_slots=2, form=form)


@pytest.mark.parametrize("splits", [2, 4])
def test_many_adapters(splits: int, kernel_device) -> None:
    slots = request_slots("distinct", 24, random.Random("many"))
    check(slots, splits, kernel_device, hidden=96, widths=(16, 8, 8), num_slots=24)


def test_an_unpadded_step_splits_its_gathered_tokens_beside_its_tiles(kernel_device, monkeypatch) -> None:
    """LoraBatch.build: decode-shaped tokens gathered and a long run tiled, each form with its partials."""
    slots = token_slots([0, 1, -1, 2, 1], [1, 1, 1, 20, 1])
    batch = LoraBatch.build(slots, kernel_device)
    assert batch.plan.num_gather == 3 and batch.plan.num_tiles(64) == 1
    a = torch.zeros(2, 3, 8, 64, device=kernel_device)
    gathered, tiled = (lora_triton.split_k(batch, a, 2, form) for form in ("gathered", "tiled"))
    assert gathered.partials.shape == (2, 2, 16, 8) and tiled.partials.shape == (2, 2, 32, 8)  # entries; tokens
    big = torch.zeros(2, 3, 8, 4 * MIN_SPLIT_K, device="meta")  # a K the plan splits
    assert lora_triton.split_k(batch, big, form="tiled").splits == 4  # K // MIN_SPLIT_K
    monkeypatch.setattr(metadata, "SPLIT_TILES", False)  # the lever: only gathered tokens split
    assert lora_triton.split_k(batch, big, form="tiled") is None and lora_triton.split_k(batch, big).splits == 4
    monkeypatch.undo()
    check(slots, 2, kernel_device, hidden=64, widths=(32, 16), rank=8, num_slots=3, form="build")


def test_fp16_split_sums_unrounded_partials(kernel_device) -> None:
    check([0, 1, -1, 2], 4, kernel_device, hidden=96, dtype=torch.float16, num_slots=3)


def test_the_plan_choice_reaches_the_kernels(kernel_device, monkeypatch) -> None:
    """splits=None: the launch plan's count from (K, tokens); a tiny K splits once MIN_SPLIT_K allows."""
    slots = [0, 1, -1, 2]
    p = make_problem(slots, hidden=96, max_rank=8, widths=[16], dtype=torch.float32, num_slots=3)
    batch = padded(slots, kernel_device)
    assert lora_triton.split_k(batch, p.lora_a) is None  # K = 96: unsplit
    monkeypatch.setattr(metadata, "MIN_SPLIT_K", 16)
    split = lora_triton.split_k(batch, p.lora_a.to(kernel_device))
    assert split.splits == 4  # the largest power of two <= min(MAX_SHRINK_SPLITS, 96 // 16)
    assert split.partials.shape == (4, 1, 16, 8) and split.partials.dtype == torch.float32
    assert lora_triton.split_k(batch, p.lora_a.to(kernel_device)).partials is split.partials  # one buffer, reused
    check(slots, None, kernel_device, hidden=96, widths=(16,), rank=8, num_slots=3)
