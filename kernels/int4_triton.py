"""Int4 weight-only base projections on the GPU: a Triton matmul that reads the packed 4-bit weight and
dequantizes it in registers (w4a16, the weights of kernels.int4_weights with activations of any float
dtype).

Decode reads every weight once per step, so bytes are the cost on a GPU: an int4 weight moves a quarter
of a bfloat16 one's bytes (plus 8 bytes per group of a row), where dequantizing first
(kernels.int4_weights.dequant_int4_linear) would write and read a float copy on top. Each program
computes a [BLOCK_T, BLOCK_N] tile of the output over all of K. Per K tile it loads the activations,
the packed bytes, and the tile's group's scale and offset per column (a K tile never straddles two groups:
the group size is a multiple of BLOCK_K), unpacks the nibbles, forms w = s * q + m in fp32 as
kernels.int4_weights defines it, rounds w to the activations' dtype (the oracle's dequantized weight,
bit for bit) and accumulates `tl.dot` in fp32. The bias is added once at the end.

T (the step's token rows) is never specialised on: the compiled variants depend on the model's
projection shapes and the row tile only (the group size is a runtime argument), and every decode
bucket's grid is fixed by its row count.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.int4_weights import GROUP_MULTIPLE, Int4Weight

SMALL_ROWS = 16  # tl.dot's minimum tile height: one row tile for decode-sized steps
BLOCK_K = 32  # every K tile within one group: group sizes are multiples of GROUP_MULTIPLE
# (rows of a prefill-sized tile, BLOCK_N output columns), keyed by UPCAST (float32 activations): half
# precision runs on the tensor cores; float32's `ieee` products run on the FMA units, whose tiles must
# be smaller to stay in registers (64 x 64 spilled 1360 bytes per thread on sm_90; benchmarks/aot/aot_check.py).
TILES = {True: (32, 32), False: (64, 64)}
assert GROUP_MULTIPLE % BLOCK_K == 0


@triton.jit(do_not_specialize=["T"])
def _int4_linear_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, bias_ptr, y_ptr,
    T, N, K, G, group_size,
    stride_xt, stride_qn, stride_yt,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Semantics: program (row tile, column tile) writes y[t, n] = sum_k x[t, k] * w[n, k] + bias[n] for its
    rows t < T and columns n < N, where w[n, k] = s[n, g] * q[n, k] + m[n, g], g = k // group_size, is
    formed in fp32 and rounded to x's dtype; accumulated in fp32 and rounded once to y's dtype. UPCAST
    (float32 activations): the products in fp32 (`ieee`, no tf32), else in the activations' dtype.
    q[n, k] is the low nibble of byte k // 2 of row n for even k, the high one for odd k.
    Shape: grid (cdiv(T, BLOCK_T), cdiv(N, BLOCK_N)); x [T, K] with unit column stride; q [N, K / 2]
    uint8 with unit column stride; s and m [N, G] float32, contiguous, G = cdiv(K,
    group_size); bias [N] (unread unless HAS_BIAS); y [T, N] with unit column stride. group_size is a
    multiple of BLOCK_K, so each K tile has one group (a runtime value: one compiled variant serves
    every group size). Row offsets are int64: T x N passes 2^31 at long prefills of wide projections."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    row_ok = rows < T
    col_ok = cols < N
    q_rows = q_ptr + cols[:, None].to(tl.int64) * stride_qn  # [BN, 1]
    sm_rows = cols.to(tl.int64) * G  # [BN]
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BT, BK]
        js = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK / 2] bytes: features 2j and 2j + 1
        # `js < K // 2` (K is even), not `2 * js < K`: the compiler sees the mask constant over 16 bytes,
        # so the weight tile is pipelined through shared memory in 16-byte copies (cp.async) rather than
        # loaded a byte at a time.
        packed = tl.load(q_rows + js[None, :], mask=col_ok[:, None] & (js < K // 2)[None, :], other=0)  # [BN, BK/2]
        q = tl.interleave(packed & 0xF, packed >> 4).to(tl.int32)  # [BN, BK]: feature 2j low, 2j + 1 high
        g = k0 // group_size
        s = tl.load(s_ptr + sm_rows + g, mask=col_ok, other=0.0)  # [BN] float32
        m = tl.load(m_ptr + sm_rows + g, mask=col_ok, other=0.0)  # [BN] float32
        w = tl.trans(s[:, None] * q.to(tl.float32) + m[:, None])  # [BK, BN]: dequantize_int4's fp32 value
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def int4_triton_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The base projection on an int4 weight in one Triton launch, F.linear's contract.

    Semantics: y = x @ dequantize_int4(w, x.dtype).T + bias, accumulated in fp32, rounded once to x's
    dtype; equal to kernels.int4_weights.dequant_int4_linear up to the order of accumulation. `scratch`
    (the int8 matmuls' signature) is not needed: the weight is dequantized in registers.
    Shape: x [T, in] with unit column stride; weight.qweight [out, in / 2] uint8, weight.scale [out, G]
    float32, weight.offset [out, G] float32; bias [out] or None; out [T, out] in x's dtype with unit column
    stride, or None; returns [T, out] (`out` itself when given).
    """
    t, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.group_size % BLOCK_K == 0
    y = torch.empty(t, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (t, n) and y.stride(1) == 1 and y.dtype == x.dtype
    if t == 0:
        return y
    upcast = x.dtype == torch.float32
    large_rows, block_n = TILES[upcast]
    block_t = SMALL_ROWS if t <= SMALL_ROWS else large_rows
    grid = (triton.cdiv(t, block_t), triton.cdiv(n, block_n))
    _int4_linear_kernel[grid](
        x, weight.qweight, weight.scale, weight.offset, bias if bias is not None else weight.scale, y,
        t, n, k, weight.scale.shape[1], weight.group_size,
        x.stride(0), weight.qweight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, UPCAST=upcast,
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
    )
    return y
