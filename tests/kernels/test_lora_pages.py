"""Adapter memory paged by rank (kernels.lora_pages): every kernel strategy reading A and B through a
page table gives each token what the unpaged slots give, with mixed ranks whose pages are scattered
over the pool (not contiguous, not in slot order) and zero pages past each adapter's own.

Triton runs under TRITON_INTERPRET=1 (conftest) on CPU, against the torch reference."""
from __future__ import annotations

import random

import pytest
import torch

from kernels import lora_cpu, lora_ref, lora_triton
from kernels.lora_pages import dense_a, dense_b
from kernels.metadata import LoraBatch
from server.engine.lora.slots import LoraGroupBuffers
from server.engine.unified_buffer import UnifiedBuffer, unallocated
from server.engine.unified_memory import UnifiedPool

pytestmark = pytest.mark.unit

HIDDEN, MAX_RANK, PAGE = 40, 16, 4
WIDTHS = (40, 12, 12)  # q, k, v of a fused qkv projection
RANKS = (4, 16, 8, 3, 12, 5)  # slot s holds an adapter of rank RANKS[s]


def _slots() -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """Unpaged slots at MAX_RANK, rows past each slot's rank zero: A [S, L, R, in], B S x [L, n, R]."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(len(WIDTHS), len(RANKS), MAX_RANK, HIDDEN, generator=g) / HIDDEN ** 0.5
    b = tuple(torch.randn(len(RANKS), n, MAX_RANK, generator=g) / MAX_RANK ** 0.5 for n in WIDTHS)
    for s, r in enumerate(RANKS):
        a[:, s, r:] = 0
        for bi in b:
            bi[s, :, r:] = 0
    return a, b, torch.rand(len(WIDTHS), len(RANKS), generator=g) + 0.5


def _unified_pages(num_pages: int, garbage: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A and B as --unified-memory's views (server.engine.unified_buffer): each page 3 units of 1,000 bytes,
    the buffers carved from one byte buffer, a page's stride past its 2,944 bytes of A and B (the rest is a
    KV block's, garbage like any free unit when `garbage`)."""
    buffers = LoraGroupBuffers.allocate(HIDDEN, WIDTHS, len(RANKS), PAGE, torch.float32, "cpu", num_pages,
                                        zeros=unallocated)
    units = 3 * (num_pages - 1)
    memory = UnifiedBuffer.allocate(UnifiedPool(units, 1000, 3, units, 0), "cpu")
    if garbage:
        memory.data.view(torch.float32).normal_()
        memory.page_bytes[0].zero_()
    memory.carve_pages([{"qkv": buffers}])
    assert all(t.untyped_storage().data_ptr() == memory.data.untyped_storage().data_ptr()
               for t in (buffers.a, *buffers.b))
    assert buffers.a.stride(1) == 3000 // 4 and not buffers.a.is_contiguous()
    return buffers.a, buffers.b


def _paged(a, b, garbage: bool, unified: bool = False):
    """The same slots as pages of PAGE rows, each adapter's pages shuffled over the pool; page 0 is the
    zero page. garbage: the pages nobody holds are full of another adapter's values (a pool after churn
    whose free pages were not zeroed must still never reach a slot through the table). unified: the pages
    are --unified-memory's strided views of one buffer (_unified_pages)."""
    pages = [-(-r // PAGE) for r in RANKS]
    num_pages = 1 + sum(pages) + 3  # the zero page, the adapters' pages, 3 free ones
    order = list(range(1, num_pages))
    random.Random(5).shuffle(order)
    if unified:
        pool_a, pool_b = _unified_pages(num_pages, garbage)
    else:
        pool_a = torch.zeros(num_pages, len(WIDTHS), PAGE, HIDDEN).transpose(0, 1)  # [S, P, p, in], page-major
        pool_b = tuple(torch.zeros(num_pages, PAGE, n).transpose(1, 2) for n in WIDTHS)  # [P, n, p]
    if garbage and not unified:
        pool_a[:, 1:].normal_()
        for pb in pool_b:
            pb[1:].normal_()
    table = torch.zeros(len(RANKS), MAX_RANK // PAGE, dtype=torch.int32)
    for s, n in enumerate(pages):
        for j in range(n):
            page = order.pop()
            table[s, j] = page
            rows = slice(j * PAGE, (j + 1) * PAGE)
            pool_a[:, page] = a[:, s, rows]
            for pb, bi in zip(pool_b, b):
                pb[page] = bi[s, :, rows]
    return pool_a, pool_b, table


def _token_slots(prefill: bool) -> list[int]:
    slots = [0, 1, -1, 2, 3, 4, 5, 1, -1, 5, 0]
    if prefill:
        slots[3:3] = [4] * 40 + [1] * 20
    return slots


def _apply(fn, x, a, b, scaling, batch, width):
    h = torch.zeros(len(WIDTHS), x.shape[0], width)
    y = torch.zeros(x.shape[0], sum(WIDTHS))
    fn(x, a, b, scaling, tuple(sum(WIDTHS[:i]) for i in range(len(WIDTHS))), batch, h, y)
    return y


def _ref_apply(x, a, b, scaling, offsets, batch, h, y):
    lora_ref.lora_shrink(x, a, batch, scaling, h)
    lora_ref.lora_expand(h, b, batch, y, offsets)


@pytest.mark.parametrize("unified", [False, True], ids=["own-buffers", "unified-pool"])
@pytest.mark.parametrize("garbage", [False, True], ids=["zeroed-pool", "dirty-free-pages"])
def test_dense_views_equal_the_slots(garbage, unified):
    a, b, _ = _slots()
    pool_a, pool_b, table = _paged(a, b, garbage, unified)
    batch = LoraBatch.build([0], page_table=table)
    torch.testing.assert_close(dense_a(pool_a, batch), a, rtol=0, atol=0)
    for got, want in zip(dense_b(pool_b, batch), b):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("unified", [False, True], ids=["own-buffers", "unified-pool"])
@pytest.mark.parametrize("prefill", [False, True], ids=["decodes", "with-prefill"])
@pytest.mark.parametrize("bounded", [False, True], ids=["full-rank", "rank-bound"])
@pytest.mark.parametrize("impl", ["ref", "cpu", "triton"])
def test_paged_equals_unpaged(impl, prefill, bounded, unified):
    a, b, scaling = _slots()
    pool_a, pool_b, table = _paged(a, b, garbage=True, unified=unified)
    slots = _token_slots(prefill)
    ranks = list(RANKS) if bounded else None
    rank_table = torch.tensor(RANKS, dtype=torch.int32) if bounded else None
    x = torch.randn(len(slots), HIDDEN, generator=torch.Generator().manual_seed(11))
    want = _apply(_ref_apply, x, a, b, scaling, LoraBatch.build(slots, slot_ranks=ranks), MAX_RANK)
    fn = {"ref": _ref_apply, "cpu": lora_cpu.lora_apply, "triton": lora_triton.lora_apply}[impl]
    batch = LoraBatch.build(slots, slot_ranks=ranks, slot_rank_table=rank_table, page_table=table)
    got = _apply(fn, x, pool_a, pool_b, scaling, batch, MAX_RANK)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got[[i for i, s in enumerate(slots) if s < 0]].abs().max() == 0  # base rows untouched


@pytest.mark.parametrize("unified", [False, True], ids=["own-buffers", "unified-pool"])
@pytest.mark.parametrize("impl", ["cpu", "triton"])
def test_padded_decode_reads_through_the_table(impl, unified):
    """A padded decode batch (every slot may occur, full rank, rows of slot -1 masked)."""
    a, b, scaling = _slots()
    pool_a, pool_b, table = _paged(a, b, garbage=True, unified=unified)
    slots = torch.tensor([5, -1, 0, 3, 1, -1], dtype=torch.int32)
    gather = torch.stack([torch.arange(len(slots), dtype=torch.int32), slots], dim=1).contiguous()
    x = torch.randn(len(slots), HIDDEN, generator=torch.Generator().manual_seed(2))
    want = _apply(_ref_apply, x, a, b, scaling, LoraBatch.build(slots.tolist()), MAX_RANK)
    fn = {"cpu": lora_cpu.lora_apply, "triton": lora_triton.lora_apply}[impl]
    batch = LoraBatch.padded_decode(slots, gather, len(RANKS), torch.tensor(RANKS, dtype=torch.int32),
                                    page_table=table)
    torch.testing.assert_close(_apply(fn, x, pool_a, pool_b, scaling, batch, MAX_RANK), want, rtol=1e-4, atol=1e-4)
