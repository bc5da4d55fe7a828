"""Int8 weight-only base projections on the GPU: a Triton matmul that reads the int8 weight and widens
it in registers (w8a16, the weights of kernels.int8_weights with activations of any float dtype).

Decode reads every weight once per step, so bytes are the cost on a GPU: an int8 weight moves half a
bfloat16 one's bytes, where dequantizing first (kernels.int8_weights.dequant_linear) would write and read
a float copy on top. Each program computes a [BLOCK_T, BLOCK_N] tile of the output over all of K: the
activations and the int8 weight tile are loaded, the weight converted to the activations' dtype (exact:
|q| <= 127 fits every float format's mantissa), multiplied with `tl.dot` into an fp32 accumulator, and
the per-row scales and the bias are applied once at the end, as kernels.int8_weights' other matmuls do.

T (the step's token rows) is never specialised on: the compiled variants depend on the model's
projection shapes and the row tile only, and every decode bucket's grid is fixed by its row count.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.int8_weights import Int8Weight

SMALL_ROWS = 16  # tl.dot's minimum tile height: one row tile for decode-sized steps
# (rows of a prefill-sized tile, BLOCK_N output columns, BLOCK_K features per iteration): half precision
# runs on the tensor cores; float32's `ieee` products run on the FMA units, whose tiles must be smaller
# to stay in registers (64 x 64 spilled 16-18 KB per thread on sm_80/sm_90, benchmarks/aot/aot_check.py).
TILES = {True: (32, 32, 32), False: (64, 64, 64)}  # keyed by UPCAST (float32 activations)


@triton.jit(do_not_specialize=["T"])
def _int8_linear_kernel(
    x_ptr, q_ptr, s_ptr, bias_ptr, y_ptr,
    T, N, K,
    stride_xt, stride_qn, stride_yt,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Semantics: program (row tile, column tile) writes y[t, n] = (sum_k x[t, k] * q[n, k]) * s[n] + bias[n]
    for its rows t < T and columns n < N, accumulated in fp32 and rounded once to y's dtype. UPCAST
    (float32 activations): the products in fp32 (`ieee`, no tf32), else in the activations' dtype.
    Shape: grid (cdiv(T, BLOCK_T), cdiv(N, BLOCK_N)); x [T, K] with unit column stride; q [N, K] int8,
    contiguous; s [N]; bias [N] (unread unless HAS_BIAS); y [T, N] with unit column stride. Row offsets
    are int64: T x N passes 2^31 at long prefills of wide projections."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    row_ok = rows < T
    col_ok = cols < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BT, BK]
        q = tl.load(q_ptr + cols[None, :].to(tl.int64) * stride_qn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0)  # [BK, BN] int8
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, q.to(tl.float32).to(x.dtype))  # via fp32: exact, and the interpreter casts it right
    acc = acc * tl.load(s_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The base projection on an int8 weight in one Triton launch, F.linear's contract.

    Semantics: y = (x @ q.T) * s + bias, accumulated in fp32, rounded once to x's dtype; equal to
    kernels.int8_weights.dequant_linear up to the order of accumulation. `scratch` (dequant_linear's
    buffer) is not needed: the weight is widened in registers.
    Shape: x [T, in] with unit column stride; weight.qweight [out, in] int8, weight.scale [out]; bias
    [out] or None; out [T, out] in x's dtype with unit column stride, or None; returns [T, out] (`out`
    itself when given).
    """
    t, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1
    y = torch.empty(t, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (t, n) and y.stride(1) == 1 and y.dtype == x.dtype
    if t == 0:
        return y
    upcast = x.dtype == torch.float32
    large_rows, block_n, block_k = TILES[upcast]
    block_t = SMALL_ROWS if t <= SMALL_ROWS else large_rows
    grid = (triton.cdiv(t, block_t), triton.cdiv(n, block_n))
    _int8_linear_kernel[grid](
        x, weight.qweight, weight.scale, bias if bias is not None else weight.scale, y,
        t, n, k,
        x.stride(0), weight.qweight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, UPCAST=upcast, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y
