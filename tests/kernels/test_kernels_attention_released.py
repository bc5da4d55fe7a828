"""Paged attention over block tables whose blocks wholly behind every query's window went back to the
pool (server.engine.block_manager.FREED, a negative entry): Triton and the torch reference never read
them, so their content (NaN here, as after reuse by another sequence) does not reach the output."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import attention_ref
from kernels.metadata import AttentionBatch
from server.engine.block_manager import FREED
from tests.kernels.test_kernels_attention import TOL, check_attention, dense_causal_attention, make_case

pytestmark = pytest.mark.unit


def release_behind(case, window: int):
    """`case` with each sequence's blocks wholly before its first query's window FREED in its table and
    poisoned in the pool."""
    block_size = case.k_cache.shape[1]
    tables = [list(t) for t in case.tables]
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    released = 0
    for table, k, n in zip(tables, case.k_full, case.query_lens):
        first_query = len(k) - n
        for i in range(max(0, first_query + 1 - window) // block_size):
            k_cache[table[i]] = v_cache[table[i]] = float("nan")
            table[i] = FREED
            released += 1
    lens = [len(k) - n for k, n in zip(case.k_full, case.query_lens)]
    batch = AttentionBatch.build(tables, lens, case.query_lens, block_size)
    return dataclasses.replace(case, batch=batch, tables=tables, k_cache=k_cache, v_cache=v_cache), released


@pytest.mark.parametrize("window", [7, 16, 20, 45])
def test_released_blocks_are_never_read(window, kernel_device) -> None:
    """Decodes and chunked prefills whose first queries sit just inside, on and past a block edge of the
    window, a fresh prompt longer than the window, and a short sequence with nothing released."""
    case = make_case([37, 0, 70, 95, 16, 5], [1, 60, 9, 1, 17, 1], 16, 8, 2, 32, torch.float32, seed=11)
    released, n = release_behind(case, window)
    assert n >= 4
    check_attention(released, kernel_device, window=window)
    check_attention(released, kernel_device, window=window, softcap=2.0)


def test_padded_decode_reference_skips_released_blocks() -> None:
    """The reference's padded decode path (a captured CUDA graph's batch, run on the CPU) reads every
    table entry up to the pool's width: released ones must read the row's own slot, not the pool."""
    window = 20
    case, n = release_behind(make_case([95, 40, 3], [1, 1, 1], 16, 8, 2, 32, torch.float32, seed=12), window)
    assert n
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    attention_ref.write_kv(case.k_new, case.v_new, k_cache, v_cache, case.batch.slot_mapping)
    width = max(len(t) for t in case.tables) + 2  # the persistent buffer is wider than any table
    tables = torch.tensor([t + [0] * (width - len(t)) for t in case.tables], dtype=torch.int32)
    lens = torch.tensor([len(k) for k in case.k_full], dtype=torch.int32)
    batch = AttentionBatch.padded_decode(case.batch.slot_mapping, tables, torch.arange(4, dtype=torch.int32),
                                         lens, lens - 1, width * 16)
    out = torch.full_like(case.q, float("nan"))
    scale = case.q.shape[2] ** -0.5
    attention_ref.paged_attention(case.q, k_cache, v_cache, batch, scale, out, window=window)
    for row, (k, v) in enumerate(zip(case.k_full, case.v_full)):
        dense = dense_causal_attention(case.q[row: row + 1], k, v, scale, window=window)
        torch.testing.assert_close(out[row: row + 1], dense, **TOL[torch.float32])
