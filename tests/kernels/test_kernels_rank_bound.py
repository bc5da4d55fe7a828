"""Bounding work by the active adapters' highest rank changes nothing: rows past it are zero."""
from __future__ import annotations

import pytest
import torch

from kernels.metadata import LoraBatch
from server.engine.kernel_choice import select_kernels

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind", ["torch", "triton"])
@pytest.mark.parametrize("token_slots", [[0, 0, 1, -1, 2, 2, 2], [2, 1, 0, -1]])
def test_rank_bound_matches_full_rank(kind, token_slots, kernel_device):
    device = kernel_device if kind == "triton" else torch.device("cpu")
    ops = select_kernels(kind, device)
    g = torch.Generator().manual_seed(0)
    slots, max_rank, hidden, outs = 4, 32, 40, (24, 8)
    ranks = [4, 8, 16, 0]  # slot 3 free
    a = torch.randn(len(outs), slots, max_rank, hidden, generator=g)
    b = tuple(torch.randn(slots, n, max_rank, generator=g) for n in outs)
    for s, r in enumerate(ranks):  # zero past each adapter's rank, as the slot pool guarantees
        a[:, s, r:] = 0
        for bi in b:
            bi[s, :, r:] = 0
    scaling = torch.rand(len(outs), slots, generator=g)
    x = torch.randn(len(token_slots), hidden, generator=g)
    results = []
    a, b, scaling, x = a.to(device), tuple(bi.to(device) for bi in b), scaling.to(device), x.to(device)
    for slot_ranks in (None, ranks):
        batch = LoraBatch.build(token_slots, device, slot_ranks)
        h = torch.zeros(len(outs), len(token_slots), max_rank, device=device)
        y = torch.ones(len(token_slots), sum(outs), device=device)
        ops.lora.shrink(x, a, batch, scaling, h)
        ops.lora.expand(h, b, batch, y, (0, outs[0]))
        results.append(y.cpu())
    bounded = LoraBatch.build(token_slots, "cpu", ranks)
    assert bounded.rank_bound == max(ranks[s] for s in set(token_slots) if s >= 0) < max_rank
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[1][token_slots.index(-1)], torch.ones(sum(outs)))


def test_gathered_kernels_stop_at_each_slots_own_rank(kernel_device):
    """With the slots' rank table, the gathered kernels read no row past a slot's own rank: rows there
    hold NaN here (the slot pool keeps them zero) and the result is still the reference's."""
    ops = select_kernels("triton", kernel_device)
    g = torch.Generator().manual_seed(1)
    slots, max_rank, hidden, outs = 3, 32, 40, (24, 8)
    ranks = [4, 20, 8]
    token_slots = [0, 2, -1, 1, 1]  # runs of at most 4 tokens: all gathered
    a = torch.randn(len(outs), slots, max_rank, hidden, generator=g)
    b = tuple(torch.randn(slots, n, max_rank, generator=g) for n in outs)
    for s, r in enumerate(ranks):
        a[:, s, r:] = 0
        for bi in b:
            bi[s, :, r:] = 0
    poisoned_a, poisoned_b = a.clone(), tuple(bi.clone() for bi in b)
    for s, r in enumerate(ranks):
        poisoned_a[:, s, r:] = float("nan")
        for bi in poisoned_b:
            bi[s, :, r:] = float("nan")
    scaling = torch.rand(len(outs), slots, generator=g)
    x = torch.randn(len(token_slots), hidden, generator=g)
    results = []
    for kind, (wa, wb), table in (("torch", (a, b), None),
                                  ("triton", (poisoned_a, poisoned_b), torch.tensor(ranks, dtype=torch.int32))):
        device = kernel_device if kind == "triton" else torch.device("cpu")
        run = ops if kind == "triton" else select_kernels("torch", device)
        batch = LoraBatch.build(token_slots, device, None, None if table is None else table.to(device))
        assert batch.effective_rank(max_rank) == max_rank  # no host bound: only the table stops the kernels
        h = torch.zeros(len(outs), len(token_slots), max_rank, device=device)
        y = torch.ones(len(token_slots), sum(outs), device=device)
        run.lora.shrink(x.to(device), wa.to(device), batch, scaling.to(device), h)
        run.lora.expand(h, tuple(bi.to(device) for bi in wb), batch, y, (0, outs[0]))
        results.append(y.cpu())
    assert torch.isfinite(results[1]).all()
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
