"""MoE expert LoRA: the torch path (kernels.expert_lora_ref) against a per-pair dense oracle, and the Triton
path (kernels.expert_lora_triton, the interpreter on a CPU) against the torch one, over pairs of several
experts and adapters of different ranks, base rows among them."""
from __future__ import annotations

import os

import pytest
import torch

from kernels import expert_lora_ref, expert_lora_triton
from kernels.expert_batch import ExpertBatch

pytestmark = pytest.mark.unit

E, L, R, IN, OUT, TOKENS, TOP_K = 3, 3, 40, 40, 72, 9, 2
# Slot s holds an adapter of rank RANKS[s], rows past it zero as in the engine; several rank tiles
# (kernels.expert_lora_triton.BLOCK_R).
RANKS = (40, 3, 21)


def operands(device: str = "cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    a = torch.zeros(E, L, R, IN)
    b = torch.zeros(E, L, R, OUT)
    for s, r in enumerate(RANKS):
        a[:, s, :r] = torch.randn(E, r, IN, generator=gen)
        b[:, s, :r] = torch.randn(E, r, OUT, generator=gen)
    scaling = torch.rand(E, L, generator=gen) + 0.5
    scores = torch.randn(TOKENS, E, generator=gen)
    top_w, top_i = torch.topk(scores.softmax(-1), TOP_K, dim=-1)
    slots = torch.tensor([0, 1, -1, 2, 0, 0, -1, 1, 2], dtype=torch.int32)
    batch = ExpertBatch.route(top_i.to(device), top_w.to(device), slots.to(device), E, L, max(RANKS))
    x = torch.randn(batch.num_pairs, IN, generator=gen)
    y = torch.randn(batch.num_pairs, OUT, generator=gen)
    to = dict(device=device, dtype=dtype)
    return x.to(**to), a.to(**to), b.to(**to), scaling.to(device), batch, y.to(**to)


def test_torch_path_is_each_pairs_own_delta():
    x, a, b, scaling, batch, y = operands()
    out = y.clone()
    expert_lora_ref.expert_lora_apply(x, a, b, scaling, batch, out)
    slots_per_expert = [{s for _, _, g, s in batch.groups if g == e} for e in range(E)]
    assert max(map(len, slots_per_expert)) >= 2, "an expert serves several adapters in the one call"
    for p in range(batch.num_pairs):
        e, s = int(batch.experts[p]), int(batch.slots[p])
        if s < 0:
            assert torch.equal(out[p], y[p])  # base rows bit-identical
            continue
        want = y[p] + scaling[e, s] * (b[e, s].t() @ (a[e, s] @ x[p]))
        torch.testing.assert_close(out[p], want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton needs a GPU or the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_path_matches_torch(dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, a, b, scaling, batch, y = operands(device, dtype)
    want, got = y.clone(), y.clone()
    expert_lora_ref.expert_lora_apply(x, a, b, scaling, batch, want)
    expert_lora_triton.expert_lora_apply(x, a, b, scaling, batch, got)
    base = batch.slots < 0
    assert torch.equal(got[base], y[base])
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
