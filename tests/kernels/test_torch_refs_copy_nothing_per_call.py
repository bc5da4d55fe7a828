"""The torch reference ops, called again on one step's batch, copy nothing between host and device: what they
read on the host is built once per batch, on the first call. benchmarks/kernels/bench_kernels.py makes that first
call outside the CUDA graph it times the others in; on the 2026-11-27 H200 run the torch rows of prefill-sized
LoRA runs and of one-sequence attention could not be captured ("Cannot copy between CPU and CUDA tensors during
CUDA graph capture") and fell back to event timing. A CPU sees no copy, so every read back to the host and every
host tensor built from a list is refused during the later call instead."""
from __future__ import annotations

import pytest
import torch

from kernels import attention_ref, lora_cpu
from kernels.metadata import LoraBatch
from tests.kernels.test_kernels_attention import make_case
from tests.server.engine.test_engine_padded_decode import HostSyncForbidden, _forbid_host_sync

pytestmark = pytest.mark.unit


def _forbid_host_copies(monkeypatch) -> None:
    _forbid_host_sync(monkeypatch)
    real = torch.tensor

    def refused(*args, **kwargs):
        raise HostSyncForbidden("torch.tensor")

    monkeypatch.setattr(torch, "tensor", refused)
    with pytest.raises(HostSyncForbidden):  # the guard is on
        real([1, 2]).tolist()


@pytest.mark.parametrize("contexts, queries", [([1024], [1]), ([0, 200, 7], [12, 1, 1])],
                         ids=["one-decode", "prompt-and-decodes"])
def test_paged_attention_builds_its_block_lists_once_per_batch(contexts, queries, monkeypatch):
    case = make_case(contexts, queries, block_size=16, hq=4, hkv=2, head_dim=32, dtype=torch.float32, seed=3)
    attention_ref.write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, case.batch.slot_mapping)
    first, again = torch.empty_like(case.q), torch.empty_like(case.q)
    attention_ref.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, 32 ** -0.5, first)
    _forbid_host_copies(monkeypatch)
    attention_ref.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, 32 ** -0.5, again)
    monkeypatch.undo()
    assert torch.equal(first, again)


@pytest.mark.parametrize("rank", [8, 5], ids=["aligned", "odd-rank"])
def test_lora_prefill_runs_read_their_group_ends_from_the_host(rank, monkeypatch):
    """Prefill-sized runs take the grouped matmul; an odd rank (and every CUDA call) a matmul per group, over
    the ends the batch keeps on the host, not offs.tolist() (a device-to-host copy per call on CUDA)."""
    g = torch.Generator().manual_seed(5)
    hidden, widths, slots = 32, (32, 16), 4
    lora_a = torch.randn(len(widths), slots, rank, hidden, generator=g)  # [S, L, R, in]
    lora_b = tuple(torch.randn(slots, n, rank, generator=g) for n in widths)  # S x [L, n, R]
    scaling = torch.ones(len(widths), slots)
    run = lora_cpu.SEGMENT_MIN_RUN
    batch = LoraBatch.build([1] * run + [3] * (run + 3) + [-1] * 4)
    x = torch.randn(len(batch.token_slots), hidden, generator=g)
    h = torch.empty(len(widths), x.shape[0], rank)
    offsets = (0, widths[0])
    first, again = torch.zeros(x.shape[0], sum(widths)), torch.zeros(x.shape[0], sum(widths))
    lora_cpu.lora_apply(x, lora_a, lora_b, scaling, offsets, batch, h, first)
    assert [b.ends for b in lora_cpu._long_blocks(batch)] == [(run, 2 * run + 3)]
    _forbid_host_copies(monkeypatch)
    lora_cpu.lora_apply(x, lora_a, lora_b, scaling, offsets, batch, h, again)
    monkeypatch.undo()
    assert torch.equal(first, again)
    want = torch.zeros_like(first)
    for t, s in enumerate(batch.token_slots.tolist()):
        if s >= 0:
            want[t] = torch.cat([(x[t] @ lora_a[i, s].T) @ lora_b[i][s].T for i in range(len(widths))])
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-4)
