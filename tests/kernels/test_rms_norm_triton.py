"""kernels.rms_norm_triton against kernels.rms_norm_ref (the torch ops the CPU path runs).

On CPU under TRITON_INTERPRET=1 (set by conftest); on the GPU when there is one (`kernel_device`).
"""
from __future__ import annotations

import pytest
import torch

from kernels import rms_norm_ref, rms_norm_triton

pytestmark = pytest.mark.unit

EPS = 1e-5
FP32_TOL = dict(atol=1e-6, rtol=1e-6)  # the sum of squares' order is the only difference
# bf16: the normed row rounds once and again after the weight, either side of the reference's; the
# interpreter's casts to bf16 truncate where the GPU's round to nearest, so the CPU allows a further ulp
# each (and on the residual's sum, exact on the GPU).
BF16_ULPS = 2


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in units in the last place of their (16-bit) dtype."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)  # monotonic in the value, -0 next to +0
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def _assert_close(got: torch.Tensor, want: torch.Tensor, device: torch.device, exact_on_gpu: bool = False) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL)
        return
    allowed = 0 if exact_on_gpu else BF16_ULPS
    if device.type != "cuda":
        allowed += 1 if exact_on_gpu else 2
    assert _ulps(got, want) <= allowed


def _inputs(rows: int, hidden: int, dtype: torch.dtype, plus_one: bool, device: torch.device):
    g = torch.Generator().manual_seed(rows * 7919 + hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
    residual = (3 * torch.randn(rows, hidden, generator=g)).to(dtype).to(device)
    w = 1 + 0.1 * torch.randn(hidden, generator=g)
    weight = (1.0 + w) if plus_one else w.to(dtype)  # as server.engine.model.RMSNorm holds it
    return x, residual, weight.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [4096, 576, 3584, 896])
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("fused", [False, True])
def test_matches_reference(dtype, hidden, rows, fused, kernel_device):
    x, residual, weight = _inputs(rows, hidden, dtype, False, kernel_device)
    if fused:
        want_r = residual.clone()
        want = rms_norm_ref.add_rms_norm(x, want_r, weight, EPS)
        got = rms_norm_triton.add_rms_norm(x, residual, weight, EPS)
        _assert_close(residual, want_r, kernel_device, exact_on_gpu=True)  # the add rounds once, as `+=` does
    else:
        want = rms_norm_ref.rms_norm(x, weight, EPS)
        got = rms_norm_triton.rms_norm(x, weight, EPS)
    assert got.dtype == want.dtype
    _assert_close(got, want, kernel_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_plus_one_gain_matches_reference(dtype, fused, kernel_device):
    """Gemma's form: the precomputed fp32 gain 1 + w applied before the cast back."""
    x, residual, weight = _inputs(37, 896, dtype, True, kernel_device)
    want_r = residual.clone()
    if fused:
        want = rms_norm_ref.add_rms_norm(x, want_r, weight, EPS, plus_one=True)
        got = rms_norm_triton.add_rms_norm(x, residual, weight, EPS, plus_one=True)
    else:
        want = rms_norm_ref.rms_norm(x, weight, EPS, plus_one=True)
        got = rms_norm_triton.rms_norm(x, weight, EPS, plus_one=True)
    _assert_close(residual, want_r, kernel_device, exact_on_gpu=True)
    assert got.dtype == dtype
    _assert_close(got, want, kernel_device)


@pytest.mark.parametrize("fused", [False, True])
def test_rows_wider_than_one_block_take_chunks(fused, monkeypatch, kernel_device):
    """Past MAX_BLOCK the row is summed over chunks and re-read (from the updated residual when fused)."""
    monkeypatch.setattr(rms_norm_triton, "MAX_BLOCK", 256)
    x, residual, weight = _inputs(5, 896, torch.bfloat16, False, kernel_device)  # 4 chunks, the last partial
    want_r = residual.clone()
    want = (rms_norm_ref.add_rms_norm(x, want_r, weight, EPS) if fused
            else rms_norm_ref.rms_norm(x, weight, EPS))
    got = (rms_norm_triton.add_rms_norm(x, residual, weight, EPS) if fused
           else rms_norm_triton.rms_norm(x, weight, EPS))
    _assert_close(residual, want_r, kernel_device, exact_on_gpu=True)
    _assert_close(got, want, kernel_device)


def test_strided_rows_and_given_out(kernel_device):
    """Rows of a wider buffer (a workspace's split) are read in place; out may be a workspace's rows too."""
    buf = torch.randn(9, 1200, device=kernel_device)
    x = buf[:, 100:676]
    weight = torch.rand(576, device=kernel_device) + 0.5
    out = torch.full((9, 700), float("nan"), device=kernel_device)[:, :576]
    got = rms_norm_triton.rms_norm(x, weight, EPS, out=out)
    assert got.data_ptr() == out.data_ptr()
    _assert_close(out, rms_norm_ref.rms_norm(x, weight, EPS), kernel_device)


def test_no_rows_launches_nothing(kernel_device):
    x = torch.empty(0, 64, device=kernel_device)
    assert rms_norm_triton.add_rms_norm(x, x.clone(), torch.ones(64, device=kernel_device), EPS).shape == (0, 64)


def test_refuses_mismatched_shapes(kernel_device):
    x = torch.randn(3, 64, device=kernel_device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton.rms_norm(x, torch.ones(32, device=kernel_device), EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton.add_rms_norm(x, torch.randn(2, 64, device=kernel_device), torch.ones(64), EPS)
    with pytest.raises(ValueError, match="out"):
        rms_norm_triton.rms_norm(x, torch.ones(64, device=kernel_device), EPS,
                                 out=torch.empty(3, 64, dtype=torch.bfloat16, device=kernel_device))
