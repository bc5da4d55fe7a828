"""The CPU LoRA path (kernels.lora_cpu) gives each token PEFT's result whatever else is in the batch:
the same rows with 1, 8 or 32 distinct adapters (chunks of different widths, padded differently),
equal to y = x W + (x A^T B^T) * scaling computed token by token, and to the reference shrink + expand."""
from __future__ import annotations

import pytest
import torch

from kernels import lora_cpu, lora_ref
from kernels.metadata import LoraBatch

pytestmark = pytest.mark.unit

HIDDEN, RANK, SLOTS = 48, 8, 32
WIDTHS = (48, 16, 16)  # q, k, v of a fused qkv projection


def _weights():
    g = torch.Generator().manual_seed(7)
    lora_a = torch.randn(len(WIDTHS), SLOTS, RANK, HIDDEN, generator=g) / HIDDEN ** 0.5  # [S, L, R, in]
    lora_b = tuple(torch.randn(SLOTS, n, RANK, generator=g) / RANK ** 0.5 for n in WIDTHS)  # S x [L, n, R]
    scaling = torch.rand(len(WIDTHS), SLOTS, generator=g) + 0.5  # [S, L]
    return lora_a, lora_b, scaling


def _peft_rows(x, slots, lora_a, lora_b, scaling):
    """PEFT's formula, one token at a time: delta = scaling * (x @ A^T) @ B^T per slice."""
    rows = []
    for t, s in enumerate(slots):
        parts = [torch.zeros(n) if s < 0 else
                 (x[t] @ lora_a[i, s].T) @ lora_b[i][s].T * scaling[i, s] for i, n in enumerate(WIDTHS)]
        rows.append(torch.cat(parts))
    return torch.stack(rows)  # [T, sum(WIDTHS)]


def _run(x, slots, lora_a, lora_b, scaling, dtype=torch.float32):
    batch = LoraBatch.build(slots)
    h = torch.zeros(len(WIDTHS), len(slots), RANK, dtype=dtype)  # [S, T, R]
    lora_b = tuple(b.to(dtype) for b in lora_b)
    y = torch.zeros(len(slots), sum(WIDTHS), dtype=dtype)  # [T, sum n]
    offsets = tuple(sum(WIDTHS[:i]) for i in range(len(WIDTHS)))
    lora_cpu.lora_apply(x.to(dtype), lora_a.to(dtype), lora_b, scaling, offsets, batch, h, y)
    return y


def _slots(num_adapters: int, tokens_per_request: int = 3) -> list[int]:
    """Requests of a few tokens each, adapters round-robin, one base-model request in the middle."""
    out = []
    for req in range(max(num_adapters, 4)):
        out += [req % num_adapters] * tokens_per_request
    out[len(out) // 2:len(out) // 2] = [-1, -1]
    return out


@pytest.mark.parametrize("num_adapters", [1, 8, 32])
@pytest.mark.parametrize("prefill", [0, 1, 3], ids=["decodes", "one-prefill", "prefills"])
def test_each_token_gets_the_peft_delta(num_adapters, prefill):
    """Short runs (gathered chunks) alone and beside runs long enough for a matmul of their own."""
    lora_a, lora_b, scaling = _weights()
    slots = _slots(num_adapters)
    for i in range(prefill):
        at = (i * 7) % len(slots)
        slots[at:at] = [(5 * i) % num_adapters] * (lora_cpu.SEGMENT_MIN_RUN + 3 * i)
    x = torch.randn(len(slots), HIDDEN, generator=torch.Generator().manual_seed(num_adapters + 100 * prefill))  # [T, in]
    got = _run(x, slots, lora_a, lora_b, scaling)
    torch.testing.assert_close(got, _peft_rows(x, slots, lora_a, lora_b, scaling), rtol=1e-5, atol=1e-5)
    assert got[[i for i, s in enumerate(slots) if s < 0]].abs().max() == 0  # base rows untouched


@pytest.mark.parametrize("slots, span", [
    ([3, 4, 5, 3, -1, 4, 5, 3], True),  # slots close together, even counts: weights read in place
    ([0, 31, 0, -1, 31, 16], False),  # a sparse span: gathered
    ([2] * 30 + [3, -1, 4, 5, 6], False),  # one adapter far busier (a short prefill chunk): gathered
])
def test_both_chunk_forms_give_the_peft_delta(slots, span):
    lora_a, lora_b, scaling = _weights()
    x = torch.randn(len(slots), HIDDEN, generator=torch.Generator().manual_seed(len(slots)))
    assert (lora_cpu._groups(LoraBatch.build(slots)).span is not None) == span
    got = _run(x, slots, lora_a, lora_b, scaling)
    torch.testing.assert_close(got, _peft_rows(x, slots, lora_a, lora_b, scaling), rtol=1e-5, atol=1e-5)
    assert got[[i for i, s in enumerate(slots) if s < 0]].abs().max() == 0


def test_bfloat16_rows_are_the_float32_delta_rounded():
    """Padding repeats a chunk's first row with a zero share: in bf16 the sum is still rounded once."""
    lora_a, lora_b, scaling = _weights()
    slots = _slots(8, tokens_per_request=5) + [3] * lora_cpu.SEGMENT_MIN_RUN
    x = torch.randn(len(slots), HIDDEN, generator=torch.Generator().manual_seed(5))
    got = _run(x, slots, lora_a, lora_b, scaling, torch.bfloat16)
    a16, b16 = lora_a.bfloat16().float(), tuple(b.bfloat16().float() for b in lora_b)
    want = _peft_rows(x.bfloat16().float(), slots, a16, b16, scaling)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert got[[i for i, s in enumerate(slots) if s < 0]].abs().max() == 0


def test_a_request_gets_the_same_rows_with_1_8_or_32_adapters_beside_it():
    lora_a, lora_b, scaling = _weights()
    probe = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(99))  # adapter 0's request
    results = []
    for num_adapters in (1, 8, 32):
        others = _slots(num_adapters)
        x = torch.cat([probe, torch.randn(len(others), HIDDEN)])
        results.append(_run(x, [0] * 5 + others, lora_a, lora_b, scaling)[:5])
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("slot_major", [True, False], ids=["slot-major", "slice-major"])
@pytest.mark.parametrize("rank_bound", [RANK, 5])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "offset-columns"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_the_reference_shrink_then_expand(slot_major, rank_bound, packed, dtype):
    """Every layout the engine or a caller may hand over: A stored slot-major (as the engine allocates
    it) or not, adapters of a lower rank than the buffers, slices at offsets inside a wider output."""
    lora_a, lora_b, scaling = _weights()
    lora_a[:, :, rank_bound:] = 0  # rows past an adapter's rank are zero in real slots
    lora_b = tuple(b.clone().index_fill_(2, torch.arange(rank_bound, RANK), 0) for b in lora_b)
    if slot_major:
        lora_a = lora_a.transpose(0, 1).contiguous().transpose(0, 1)
    lora_a, lora_b = lora_a.to(dtype), tuple(b.to(dtype) for b in lora_b)
    run = lora_cpu.SEGMENT_MIN_RUN
    slots = _slots(32) + [7] * run + [2] * (run + 8) + [3, 9, -1, 3] + [5] * (run + 1)
    batch = LoraBatch.build(slots, slot_ranks=[rank_bound] * SLOTS)
    # Two stretches of prefill-sized runs: adjacent runs of adapters 7 and 2 share grouped matmuls.
    assert [b.offs.tolist() for b in lora_cpu._long_blocks(batch)] == [[run, 2 * run + 8], [run + 1]]
    x = torch.randn(len(slots), HIDDEN, generator=torch.Generator().manual_seed(11)).to(dtype)
    pad = 0 if packed else 5
    offsets = tuple(pad + sum(WIDTHS[:i]) for i in range(len(WIDTHS)))
    y0 = torch.randn(len(slots), pad + sum(WIDTHS) + pad, generator=torch.Generator().manual_seed(12)).to(dtype)
    want, got = y0.clone(), y0.clone()
    h = torch.zeros(len(WIDTHS), len(slots), RANK, dtype=dtype)
    lora_ref.lora_shrink(x, lora_a, batch, scaling, h)
    lora_ref.lora_expand(h, lora_b, batch, want, offsets)
    lora_cpu.lora_apply(x, lora_a, lora_b, scaling, offsets, batch, torch.empty_like(h), got)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    base = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base], y0[base])  # rows without an adapter are bit-identical
    if not packed:
        assert torch.equal(got[:, :pad], y0[:, :pad]) and torch.equal(got[:, -pad:], y0[:, -pad:])
