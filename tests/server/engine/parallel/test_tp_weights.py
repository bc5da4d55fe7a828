"""A quantized base cut for tensor-parallel ranks (server.engine.parallel.tp_weights): the shards are TP = 1's
integers and scales, so column shards side by side and row shards summed give TP = 1's product."""
from __future__ import annotations

import pytest
import torch

from kernels.fp8_weights import quantize_fp8
from kernels.int4_weights import dequant_int4_linear, quantize_int4
from kernels.int8_weights import dequant_linear, quantize_int8
from server.engine.parallel.tp_weights import vocab_shard, weight_columns, weight_rows

pytestmark = pytest.mark.unit

LINEAR = {"int8": (quantize_int8, dequant_linear), "int4": (lambda w: quantize_int4(w, 32), dequant_int4_linear)}


@pytest.mark.parametrize("kind", sorted(LINEAR))
def test_shards_reproduce_the_full_quantized_product(kind):
    quantize, linear = LINEAR[kind]
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 128, generator=gen), torch.randn(5, 128, generator=gen)
    full = quantize(w)
    want = linear(x, full)
    rows = [weight_rows(full, torch.arange(lo, lo + 24)) for lo in (0, 24)]
    assert torch.equal(torch.cat([linear(x, part) for part in rows], dim=1), want)
    cols = [weight_columns(full, lo, lo + 64) for lo in (0, 64)]
    assert torch.allclose(sum(linear(x[:, lo:lo + 64], part) for lo, part in zip((0, 64), cols)), want,
                          rtol=0, atol=1e-5)


def test_int4_row_shards_start_on_a_group():
    full = quantize_int4(torch.randn(8, 128), 64)
    with pytest.raises(ValueError, match="int4 groups of 64 input channels do not split at column 32"):
        weight_columns(full, 32, 96)


def test_fp8_is_not_cut():
    with pytest.raises(ValueError, match=r"a quantized base \(fp8\) is not sharded"):
        weight_columns(quantize_fp8(torch.randn(16, 32)), 0, 16)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
def test_vocab_shards_pad_with_zero_rows(quantized):
    head = torch.randn(7, 16)
    weight = quantize_int8(head) if quantized else head
    shards = [vocab_shard(weight, rank, 2) for rank in (0, 1)]
    x = torch.randn(3, 16)
    logits = torch.cat([dequant_linear(x, s) if quantized else x @ s.t() for s in shards], dim=1)
    assert logits.shape == (3, 8) and torch.equal(logits[:, 7], torch.zeros(3))
    full = dequant_linear(x, weight) if quantized else x @ head.t()
    assert torch.allclose(logits[:, :7], full, rtol=0, atol=1e-6)
