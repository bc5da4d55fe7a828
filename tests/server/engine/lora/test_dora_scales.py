"""server.engine.lora.dora_scales against PEFT's formula m / ||W + scaling * B @ A|| (materialised, row norms):
the expanded norm, blocks of rows, rows an adapter nearly cancels, an all-zero row, an int8 base; and the
served-weights identity stored scales are keyed by (server.engine.lora.dora_scale_cache)."""
from __future__ import annotations

import pytest
import torch

from kernels.int4_weights import dequantize_int4, quantize_int4
from kernels.int8_weights import quantize_int8
from server.engine.lora import dora_scale_cache, dora_scales
from server.engine.lora.dora_scales import DoraScales

pytestmark = pytest.mark.unit


def peft_scale(w, a, b, scaling, m):
    """PEFT 0.21's DoraLinearLayer: get_weight_norm on W + scaling * (B @ A), then m / norm."""
    return m / torch.linalg.norm(w + scaling * (b @ a), dim=1)


def case(seed: int, out: int = 96, width: int = 80, r: int = 8):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, width, generator=gen)  # [out, in]
    a = torch.randn(r, width, generator=gen) / width ** 0.5  # [r, in]
    b = torch.randn(out, r, generator=gen) * 0.3  # [out, r]
    m = torch.rand(out, generator=gen) + 0.5  # [out]
    return w, a, b, m


def scales(weight, a, b, scaling, m, row: int = 0) -> torch.Tensor:
    out = torch.empty(b.shape[0])
    DoraScales([{"o": weight}]).compute(0, "o", row, a, b, scaling, m, out)
    return out


@pytest.mark.parametrize("block", [dora_scales.BLOCK_ELEMENTS, 80 * 7])  # one block; blocks of 7 rows
def test_scales_equal_peft(monkeypatch, block):
    monkeypatch.setattr(dora_scales, "BLOCK_ELEMENTS", block)
    w, a, b, m = case(1)
    got = scales(w, a, b, 2.5, m)
    torch.testing.assert_close(got, peft_scale(w, a, b, 2.5, m), rtol=1e-6, atol=0)


def test_a_slice_of_a_fused_weight():
    """A projection is rows row .. row + n of its fused weight (k_proj inside qkv)."""
    w, a, b, m = case(2)
    fused = torch.cat([torch.randn(40, 80), w, torch.randn(16, 80)])
    torch.testing.assert_close(scales(fused, a, b, 0.5, m, row=40), peft_scale(w, a, b, 0.5, m), rtol=1e-6, atol=0)


def test_rows_the_adapter_nearly_cancels_are_exact():
    """W_j + s (B A)_j a thousandth of W_j: the expansion alone would lose ~3 digits there."""
    w, a, b, m = case(3)
    scaling = 2.0
    a[0] = w[5]
    b[5] = 0
    b[5, 0] = -(1 - 1e-3) / scaling
    got, expected = scales(w, a, b, scaling, m), peft_scale(w, a, b, scaling, m)
    assert expected[5] > 100 * expected.median()  # the row is nearly cancelled: a huge scale
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_an_all_zero_row_gets_scale_zero():
    w, a, b, m = case(4)
    w[7] = 0
    b[7] = 0
    got = scales(w, a, b, 1.0, m)
    assert got[7] == 0 and torch.isfinite(got).all()


def test_an_int8_base_is_dequantized():
    w, a, b, m = case(5)
    q = quantize_int8(w)
    dequantized = q.qweight.float() * q.scale[:, None].float()
    torch.testing.assert_close(scales(q, a, b, 1.5, m), peft_scale(dequantized, a, b, 1.5, m), rtol=1e-6, atol=0)


def test_an_int4_base_is_dequantized():
    w, a, b, m = case(6)
    q = quantize_int4(w, 32)
    torch.testing.assert_close(scales(q, a, b, 1.5, m), peft_scale(dequantize_int4(q), a, b, 1.5, m), rtol=1e-6, atol=0)


def test_the_base_identity_is_the_served_bytes(monkeypatch):
    """The same bytes give the same identity however many threads hash them; one changed element, another
    dtype, or the same weights served int8-quantized give another."""
    gen = torch.Generator().manual_seed(7)
    layers = [{"qkv": torch.randn(24, 16, generator=gen), "o": torch.randn(16, 16, generator=gen)} for _ in range(3)]
    identity = dora_scale_cache.served_weights_identity
    base = identity(layers)
    monkeypatch.setattr(dora_scale_cache, "IDENTITY_THREADS", 1)
    assert identity([{g: w.clone() for g, w in layer.items()} for layer in layers]) == base
    changed = [{g: w.clone() for g, w in layer.items()} for layer in layers]
    changed[2]["o"][5, 3] += 1e-6
    others = {identity(changed), identity([{g: w.bfloat16() for g, w in layer.items()} for layer in layers]),
              identity([{g: quantize_int8(w) for g, w in layer.items()} for layer in layers]),
              identity([{g: quantize_int4(w, 32) for g, w in layer.items()} for layer in layers]),
              identity([{g: quantize_int4(w, 64) for g, w in layer.items()} for layer in layers])}
    assert len(others) == 5 and base not in others
