"""kernels.int4_triton, the GPU's int4 weight-only matmul, against the dequantized product (under the
Triton interpreter without a GPU): groups of 32, 64 and 128 with a short last group, GPTQ's zeros 0..16,
ragged rows and columns, bias, strided rows; and the engine on the Triton kernel set with int4 weights
against transformers + peft on the same dequantized weights."""
from __future__ import annotations

import pytest
import torch

from kernels.int4_triton import int4_triton_linear
from kernels.int4_weights import Int4Weight, dequant_int4_linear, dequantize_int4, pack_nibbles, quantize_int4
from server.engine import LLM
from server.engine.kernel_choice import triton_ops
from tests.server.engine.test_engine_int4 import write_int4_reference
from tests.kernels.test_int8_triton import assert_mixed_batch_matches_quantized_peft

# (rows, out, in, group size). Rows: one decode row, a small row tile's edge and one past it, a prefill
# past one large tile; out off the 32 and 64 column tiles; in not a multiple of the group (a short last
# group, shorter than a K tile in the first two).
SHAPES = [(1, 96, 80, 32), (16, 40, 144, 64), (17, 70, 200, 128), (70, 130, 272, 64)]
# float32: products in fp32 (ieee); half precision: the weight rounded as the oracle's, the output
# rounded once from the fp32 accumulator.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 runs on a GPU (the interpreter has no bf16)")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def random_int4(n: int, k: int, group_size: int, g: torch.Generator, device: torch.device) -> Int4Weight:
    """Every nibble and every zero a GPTQ checkpoint can hold (0..16, offset -scale * zero), and an
    arbitrary float offset in every other group."""
    groups = -(-k // group_size)
    q = torch.randint(0, 16, (n, k), generator=g)
    zero = torch.randint(0, 17, (n, groups), generator=g).float()
    scale = torch.rand(n, groups, generator=g) * 0.1 + 1e-3
    offset = torch.where(torch.arange(groups) % 2 == 0, -scale * zero, torch.randn(n, groups, generator=g) * 0.3)
    return Int4Weight(pack_nibbles(q).to(device), scale.to(device), offset.contiguous().to(device), group_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t, n, k, group_size", SHAPES)
def test_the_kernel_equals_the_dequantized_matmul(kernel_device, dtype, bias, t, n, k, group_size):
    g = torch.Generator().manual_seed(t * 1000 + n + k)
    w = random_int4(n, k, group_size, g, kernel_device)
    x = torch.randn(t, k, generator=g).to(kernel_device, dtype)
    b = torch.randn(n, generator=g).to(kernel_device, dtype) if bias else None
    ref = torch.nn.functional.linear(x.double(), dequantize_int4(w, dtype).double(),
                                     None if b is None else b.double())  # [T, N]
    y = int4_triton_linear(x, w, b)
    assert y.dtype == dtype and y.shape == (t, n)
    scale = ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() <= TOL[dtype] * scale
    assert (dequant_int4_linear(x, w, b).double() - ref).abs().max().item() <= TOL[dtype] * scale  # one oracle
    out = torch.full((t, n), float("nan"), dtype=dtype, device=kernel_device)
    assert int4_triton_linear(x, w, b, out=out) is out and torch.equal(out, y)  # every element written, same bits


@pytest.mark.parametrize("n, k, group_size", [(40, 144, 64), (24, 80, 128)])  # groups 64, 64, 16; one short group
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_hot_rows_read_out_the_dequantized_weight_bit_for_bit(kernel_device, dtype, n, k, group_size):
    """Row t of the identity picks column t of w: one product per output, so y is w[:, t] exactly as
    the oracle dequantizes it (s * q + m in fp32, rounded to x's dtype) for every nibble position,
    group (the short last one included) and offset. The rows are a strided view, as the engine's
    workspace rows are. On a GPU the compiler may fuse s * q + m into one FMA (one rounding fewer):
    there, within a unit in the last place of x's dtype."""
    w = random_int4(n, k, group_size, torch.Generator().manual_seed(k), kernel_device)
    x_wide = torch.zeros(k, k + 8, dtype=dtype, device=kernel_device)
    x = x_wide[:, 4:4 + k]  # [K, K], row stride K + 8
    x.copy_(torch.eye(k, dtype=dtype, device=kernel_device))
    y = int4_triton_linear(x, w)
    if kernel_device.type == "cuda":
        torch.testing.assert_close(y, dequantize_int4(w, dtype).t(), rtol=torch.finfo(dtype).eps, atol=0)
    else:
        assert torch.equal(y, dequantize_int4(w, dtype).t())


def test_a_strided_output_and_input_rows_are_honoured(kernel_device):
    """The engine's workspace rows and split qkv views: row strides wider than the row."""
    g = torch.Generator().manual_seed(5)
    w = quantize_int4(torch.randn(48, 96, generator=g), group_size=32)
    w = Int4Weight(w.qweight.to(kernel_device), w.scale.to(kernel_device), w.offset.to(kernel_device), 32)
    x_wide = torch.randn(5, 100, generator=g).to(kernel_device)
    x = x_wide[:, :96]  # [5, 96], row stride 100
    y_wide = torch.zeros(5, 60, device=kernel_device)
    y = int4_triton_linear(x, w, out=y_wide[:, 4:52])
    ref = x.double() @ dequantize_int4(w, torch.float64).t()
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert torch.all(y_wide[:, :4] == 0) and torch.all(y_wide[:, 52:] == 0)


def test_no_rows_launch_nothing(kernel_device):
    w = random_int4(8, 64, 32, torch.Generator().manual_seed(1), kernel_device)
    assert int4_triton_linear(torch.empty(0, 64, device=kernel_device), w).shape == (0, 8)


def test_the_triton_kernel_set_runs_it():
    assert triton_ops().int4_linear is int4_triton_linear


def test_the_triton_engine_with_int4_weights_matches_quantized_peft(kernel_device, tiny_model_dir, tiny_adapters,
                                                                    tmp_path, peft_oracle):
    """The kernel set a GPU runs (Triton LoRA, attention and this matmul) with int4 projections, mixed
    adapters and base rows: the oracle's tokens and logprobs on the same dequantized weights."""
    reference = write_int4_reference(tiny_model_dir, tmp_path)
    llm = LLM(tiny_model_dir, device=kernel_device.type, dtype="float32", kernels="triton", max_loras=2,
              kv_cache_blocks=64, max_model_len=128, quantization="int4")
    assert llm.engine.kernels.int4_linear is int4_triton_linear
    assert_mixed_batch_matches_quantized_peft(llm, reference, tiny_adapters, peft_oracle)
