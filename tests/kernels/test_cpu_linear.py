"""Half-precision projections on CPUs without half-precision matmul instructions compute in float32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_linear import cpu_flags, linear, linear_for, upcast_linear
from server.engine.kernel_choice import select_kernels

pytestmark = pytest.mark.unit


def test_upcast_linear_is_the_float32_product_rounded_once():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g).bfloat16()
    w = torch.randn(48, 64, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    y = upcast_linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (7, 48)
    assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).bfloat16())
    # The native half-precision product agrees to within its own rounding (float32 accumulation).
    torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=6e-2)
    assert torch.equal(upcast_linear(x.half(), w.half()), F.linear(x.float(), w.float()).half())


def test_the_cpu_flags_pick_the_matmul(tmp_path):
    cpu = torch.device("cpu")
    assert linear_for(cpu, torch.float32, frozenset()) is linear
    assert linear_for(cpu, torch.bfloat16, frozenset({"avx2", "fma"})) is upcast_linear  # an AVX2 EPYC
    assert linear_for(cpu, torch.bfloat16, frozenset({"avx512f", "avx512_bf16"})) is linear
    assert linear_for(cpu, torch.bfloat16, frozenset({"amx_bf16", "amx_tile"})) is linear
    assert linear_for(cpu, torch.float16, frozenset({"amx_bf16"})) is upcast_linear
    assert linear_for(torch.device("meta"), torch.bfloat16, frozenset()) is linear  # not a CPU
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_the_engine_kernels_carry_the_choice():
    cpu = torch.device("cpu")
    assert select_kernels("torch", cpu, torch.float32).linear is linear
    want = linear_for(cpu, torch.bfloat16)  # this machine's answer, whichever it is
    assert select_kernels("auto", cpu, torch.bfloat16).linear is want


def test_linear_into_a_buffer_is_f_linear_bit_for_bit():
    """The model writes projections into its preallocated workspace: same numbers as a fresh F.linear."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(37, 96, generator=g).to(dtype)
        w = torch.randn(80, 96, generator=g).to(dtype)
        b = torch.randn(80, generator=g).to(dtype)
        buf = torch.full((64, 80), float("nan"), dtype=dtype)
        for bias in (None, b):
            out = buf[:37]
            y = linear(x, w, bias, out=out)
            assert y.data_ptr() == buf.data_ptr() and torch.equal(y, F.linear(x, w, bias))
            assert buf[37:].isnan().all()  # rows past T are left alone
            y = upcast_linear(x, w, bias, out=out)
            assert y.data_ptr() == buf.data_ptr() and torch.equal(y, upcast_linear(x, w, bias))
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # no buffer: F.linear itself
