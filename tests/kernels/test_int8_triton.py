"""kernels.int8_triton, the GPU's int8 weight-only matmul, against the dequantized product (under the
Triton interpreter without a GPU), and the engine on the Triton kernel set with int8 weights against
transformers + peft on the same quantized weights."""
from __future__ import annotations

import pytest
import torch

from kernels.int8_triton import int8_linear
from kernels.int8_weights import dequantize_int8, quantize_int8
from server.engine import LLM, SamplingParams
from tests.engine_helpers import GREEDY, assert_matches_peft, random_prompts
from tests.server.engine.test_engine_int8 import LOGPROB_TOL, VOCAB, max_logprob_gap, write_quantized_reference

# Rows: one decode row, a small row tile's edge and one past it, a prefill past one large tile; columns
# and features off the 64 tiles.
SHAPES = [(1, 96, 80), (16, 64, 64), (17, 200, 150), (70, 130, 200)]
# float32: products in fp32 (ieee); half precision: rounded once from the fp32 accumulator.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 runs on a GPU (the interpreter has no bf16)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t, n, k", SHAPES)
def test_the_kernel_equals_the_dequantized_matmul(kernel_device, dtype, bias, t, n, k):
    g = torch.Generator().manual_seed(t * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    q = quantize_int8(w, scale_dtype=dtype)
    q = type(q)(q.qweight.to(kernel_device), q.scale.to(kernel_device))
    x = torch.randn(t, k, generator=g).to(kernel_device, dtype)
    b = torch.randn(n, generator=g).to(kernel_device, dtype) if bias else None
    ref = torch.nn.functional.linear(x.double(), dequantize_int8(q, torch.float64),
                                     None if b is None else b.double())  # [T, N]
    y = int8_linear(x, q, b)
    assert y.dtype == dtype and y.shape == (t, n)
    scale = ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() <= TOL[dtype] * scale
    out = torch.full((t, n), float("nan"), dtype=dtype, device=kernel_device)
    assert int8_linear(x, q, b, out=out) is out and torch.equal(out, y)  # every element written, same bits


def test_a_strided_output_and_input_rows_are_honoured(kernel_device):
    """The engine's workspace rows and split qkv views: row strides wider than the row."""
    g = torch.Generator().manual_seed(5)
    q = quantize_int8(torch.randn(48, 32, generator=g))
    q = type(q)(q.qweight.to(kernel_device), q.scale.to(kernel_device))
    x_wide = torch.randn(5, 40, generator=g).to(kernel_device)
    x = x_wide[:, :32]  # [5, 32], row stride 40
    y_wide = torch.zeros(5, 60, device=kernel_device)
    y = int8_linear(x, q, out=y_wide[:, 4:52])
    ref = x.double() @ dequantize_int8(q, torch.float64).t()
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert torch.all(y_wide[:, :4] == 0) and torch.all(y_wide[:, 52:] == 0)


def test_the_triton_engine_with_int8_weights_matches_quantized_peft(kernel_device, tiny_model_dir, tiny_adapters,
                                                                    tmp_path, peft_oracle):
    """The kernel set a GPU runs (Triton LoRA, attention and this matmul), with int8 projections and
    head, mixed adapters and base rows: the quantized oracle's tokens and logprobs."""
    reference = write_quantized_reference(tiny_model_dir, tmp_path, lm_head=True)
    llm = LLM(tiny_model_dir, device=kernel_device.type, dtype="float32", kernels="triton", max_loras=2,
              kv_cache_blocks=64, max_model_len=128, quantization="int8", quantize_lm_head=True)
    assert llm.engine.kernels.int8_linear is int8_linear
    assert_mixed_batch_matches_quantized_peft(llm, reference, tiny_adapters, peft_oracle)


def assert_mixed_batch_matches_quantized_peft(llm, reference, tiny_adapters, peft_oracle) -> None:
    """Two adapters and base rows, 5 greedy tokens each: peft's tokens on `reference` (the same quantized
    weights, dequantized), logprobs within the quantized tolerance."""
    adapters = {n: tiny_adapters[n] for n in ("r8_all", "r4_qv")}
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    names = ["r8_all", None, "r4_qv", "r8_all"]
    prompts = random_prompts(len(names), (4, 20), VOCAB, seed=31)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, logprobs=0, **GREEDY), adapters=names)
    assert_matches_peft(llm, reference, adapters, prompts, names, outs, 5, peft_oracle)
    assert max_logprob_gap(reference, adapters, prompts, names, outs) <= LOGPROB_TOL
