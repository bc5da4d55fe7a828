"""kernels.int8_avx2: the AVX2 int8 matmul against the dequantized float64 reference on the
projection shapes the models use (fused qkv, gate_up, down), odd sizes and 1..17 token rows; its
operand checks; the build cache; and the fallback to dequant_linear, with a log line, when it
cannot be built."""
from __future__ import annotations

import logging
import shutil
import os

import pytest
import torch

from kernels.cpu_linear import cpu_flags
from kernels.int8_avx2 import (REQUIRED_FLAGS, KernelBuildError, avx2_int8_linear_or_none, build_library,
                               load_avx2_int8_linear)
from kernels.int8_weights import dequant_linear, dequantize_int8, int8_linear_for, int8pack_linear, quantize_int8

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
HAS_AVX2 = REQUIRED_FLAGS <= cpu_flags()
needs_avx2 = pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2 + FMA")
HAS_COMPILER = shutil.which(os.environ.get("CXX") or "g++") is not None  # scripts/test installs g++ where it can
NO_COMPILER = "no C++ compiler (g++): the AVX2 int8 kernel cannot be built here (the engine runs dequant_linear)"
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason=NO_COMPILER)


@pytest.fixture(scope="module")
def avx2_linear(tmp_path_factory):
    if not HAS_AVX2:
        pytest.skip("this CPU has no AVX2 + FMA")
    if not HAS_COMPILER:
        pytest.skip(NO_COMPILER)
    return load_avx2_int8_linear(tmp_path_factory.mktemp("kernels"))  # with a compiler, a failed build fails


def reference(x, q, bias):
    """x @ (q * s).T + bias in float64: [T, out]."""
    y = x.double() @ dequantize_int8(q).double().t()
    return y if bias is None else y + bias.double()


SHAPES = [
    (960, 576),  # smol135's fused qkv
    (3072, 576),  # smol135's fused gate_up
    (576, 1536),  # smol135's down
    (7, 13),  # fewer rows than a block, in % 8 != 0
    (100, 37),
    (33, 9),
    (40, 8),
    (5, 3),  # in < 8: the scalar tail alone
]


@pytest.mark.parametrize("n_out, n_in", SHAPES)
@pytest.mark.parametrize("n_tok", [1, 2, 3, 5, 8, 9, 17])
def test_equals_the_dequantized_matmul(avx2_linear, n_out, n_in, n_tok):
    g = torch.Generator().manual_seed(n_out * 31 + n_in + n_tok)
    q = quantize_int8(torch.randn(n_out, n_in, generator=g))
    x = torch.randn(n_tok, n_in, generator=g)  # [T, in]
    bias = torch.randn(n_out, generator=g) if n_tok % 2 else None
    ref = reference(x, q, bias)  # [T, out]
    y = avx2_linear(x, q, bias)
    assert y.shape == (n_tok, n_out) and y.dtype == torch.float32
    # float32 accumulation of n_in products, in another order than the reference's
    tol = 1e-6 * n_in * (x.abs().max() * q.scale.max() * 127 + 1)
    assert (y.double() - ref).abs().max() <= tol


def test_writes_into_strided_workspace_rows_and_reads_strided_input(avx2_linear):
    g = torch.Generator().manual_seed(5)
    q = quantize_int8(torch.randn(24, 40, generator=g))
    x = torch.randn(40, 6, generator=g).t()  # [6, 40], not contiguous
    workspace = torch.full((6, 30), float("nan"))
    out = workspace[:, 3:27]  # [6, 24]: row stride 30, unit column stride
    assert avx2_linear(x, q, out=out) is out
    assert torch.allclose(out.double(), reference(x, q, None), atol=1e-4)
    assert workspace[:, :3].isnan().all() and workspace[:, 27:].isnan().all()  # nothing written outside


def test_thread_count_changes_nothing(avx2_linear):
    g = torch.Generator().manual_seed(6)
    q = quantize_int8(torch.randn(300, 64, generator=g))
    x = torch.randn(9, 64, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = avx2_linear(x, q)
        torch.set_num_threads(2)
        two = avx2_linear(x, q)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output is one thread's, accumulated in the same order


@pytest.mark.parametrize("bad", ["x_dtype", "in_mismatch", "out_shape", "out_column_stride", "bias_shape",
                                 "scale_dtype"])
def test_operands_it_cannot_take_are_refused(avx2_linear, bad):
    q = quantize_int8(torch.randn(16, 24))
    x, out, bias = torch.randn(4, 24), None, None
    if bad == "x_dtype":
        x = x.bfloat16()
    elif bad == "in_mismatch":
        x = torch.randn(4, 25)
    elif bad == "out_shape":
        out = torch.empty(4, 15)
    elif bad == "out_column_stride":
        out = torch.empty(16, 4).t()
    elif bad == "bias_shape":
        bias = torch.randn(15)
    else:
        q = quantize_int8(torch.randn(16, 24), scale_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="avx2_int8_linear takes"):
        avx2_linear(x, q, bias, out=out)


@needs_avx2
@needs_compiler
def test_the_build_is_cached(tmp_path):
    lib = build_library(tmp_path)
    mtime = lib.stat().st_mtime_ns
    assert build_library(tmp_path) == lib and lib.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no temporary file left behind


@pytest.mark.parametrize("compiler, reason", [("no-such-compiler-xyz", r"no C\+\+ compiler"), ("false", "failed")])
def test_a_failed_build_is_an_error_naming_why(tmp_path, compiler, reason):
    with pytest.raises(KernelBuildError, match=reason):
        build_library(tmp_path, compiler)
    assert list(tmp_path.iterdir()) == []  # no library, no temporary file left behind


@needs_compiler
def test_an_unwritable_cache_is_a_build_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(KernelBuildError, match="cannot build the kernel"):
        load_avx2_int8_linear(not_a_dir / "kernels")


def test_without_a_compiler_the_engine_falls_back_to_dequant_linear_and_says_so(caplog):
    avx2_cpu = frozenset({"avx2", "fma"})
    with caplog.at_level(logging.WARNING, logger="kernels.int8_avx2"):
        chosen = int8_linear_for(CPU, torch.float32, avx2_cpu, compiler="no-such-compiler-xyz")
    assert chosen is dequant_linear
    assert "no C++ compiler 'no-such-compiler-xyz'" in caplog.text and "dequantizing" in caplog.text


def test_the_choice_per_cpu_and_dtype():
    assert int8_linear_for(CPU, torch.float32, frozenset({"avx2", "fma", "avx512f"})) is int8pack_linear
    assert int8_linear_for(CPU, torch.float32, frozenset({"avx2"})) is dequant_linear  # no FMA
    assert int8_linear_for(CPU, torch.bfloat16, frozenset({"avx2", "fma"})) is dequant_linear
    assert avx2_int8_linear_or_none(frozenset({"sse4_2"})) is None
    if HAS_AVX2 and HAS_COMPILER:
        assert int8_linear_for(CPU, torch.float32, frozenset({"avx2", "fma"})).__name__ == "avx2_int8_linear"
