"""--unified-memory's one allocation (server.engine.unified_buffer): the KV views and the page views are the
same bytes, a page being the aligned group of units after the zero page, and copy-on-write's block copies
(model_runner.copy_blocks) move a block's K and V of every layer through the strided views, fp8 too."""
from __future__ import annotations

import pytest
import torch

from server.engine.lora.slots import LoraGroupBuffers
from server.engine.model_runner import copy_blocks
from server.engine.unified_buffer import UnifiedBuffer, unallocated
from server.engine.unified_memory import UnifiedPool

pytestmark = pytest.mark.unit

LAYERS, BLOCK, HKV, D = 2, 4, 2, 8


def _pool(dtype: torch.dtype, units: int = 6, per_page: int = 2) -> UnifiedBuffer:
    unit = 2 * LAYERS * BLOCK * HKV * D * torch.empty((), dtype=dtype).element_size()
    return UnifiedBuffer.allocate(UnifiedPool(units, unit, per_page, units, 0), "cpu")


def test_a_page_is_the_bytes_of_its_units_kv_blocks():
    memory = _pool(torch.float32)
    kv = memory.kv_caches(LAYERS, BLOCK, HKV, D, torch.float32)
    group = LoraGroupBuffers.allocate(16, (8, 8), 2, 4, torch.float32, "cpu", memory.pool.pages + 1,
                                      zeros=unallocated)
    memory.carve_pages([{"o": group}])
    assert {t.untyped_storage().data_ptr() for t in (*[x for p in kv for x in p], group.a, *group.b)} == {
        memory.data.untyped_storage().data_ptr()}
    page = 2  # units 2 and 3: KV blocks 2 and 3
    memory.page_bytes[page].view(torch.float32).copy_(torch.arange(memory.pool.page_bytes // 4))
    k0 = kv[0][0]  # block b's first bytes are token 0's layer-0 K
    assert k0[2, 0, 0, 0] == 0 and k0[3, 0, 0, 0] == memory.pool.unit_bytes // 4
    assert torch.equal(group.a[0, page, 0, :D], k0[2, 0, 0])  # a page's first bytes are A's slice 0, row 0
    memory.page_bytes[page].zero_()
    assert not kv[1][1][2:4].any() and not group.a[:, page].any() and not group.b[1][page].any()
    assert kv[0][0][1].sum() == 0 and memory.page_bytes[0].sum() == 0  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["f32", "fp8"])
def test_copy_blocks_moves_every_layers_kv_through_the_views(dtype):
    memory = _pool(dtype)
    kv = memory.kv_caches(LAYERS, BLOCK, HKV, D, dtype)
    for k, v in kv:
        k.copy_(torch.randn(k.shape).to(dtype))
        v.copy_(torch.randn(v.shape).to(dtype))
    before = [(k.clone(), v.clone()) for k, v in kv]
    copy_blocks(kv, [(1, 4), (2, 0)], torch.device("cpu"))
    for now, then in zip(kv, before):
        for a, b in zip(now, then):
            a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(a[4], b[1]) and torch.equal(a[0], b[2])
            assert torch.equal(a[[1, 2, 3, 5]], b[[1, 2, 3, 5]])
