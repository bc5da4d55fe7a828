"""benchmarks/engine/bench_rank_pages.py counts adapters in a real LoraSlots until the next does not fit:
pages by rank when paged, one slot each otherwise."""
from __future__ import annotations

import pytest

from benchmarks.engine.bench_rank_pages import MIXED, resident
from server.engine.lora.paging import LoraPaging

pytestmark = pytest.mark.unit


def test_residency_counts_pages_by_rank():
    # 2 slots' worth at max rank 128 = 32 pages of 8 rows: ranks 8, 16, 64, 128 take 1, 2, 8, 16 pages; after
    # 27 pages the next rank 8 and rank 16 fit (30), rank 64 does not.
    assert resident(LoraPaging.of(2, 128, 8), MIXED) == 6
    assert resident(LoraPaging.of(2, 128, None), MIXED) == 2
    assert resident(LoraPaging.of(2, 128, 8), (128,)) == 2
