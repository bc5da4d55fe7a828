"""Triton RMSNorm, alone or fused with the residual add before it, with the semantics of kernels.rms_norm_ref.

Torch's RMSNorm is 6-8 launches (cast, pow, mean, add eps, rsqrt, mul, cast, mul weight) and the residual
add before it another; here it is one launch of one program per row, the row's hidden in one BLOCK
(a few chunks past MAX_BLOCK), accumulated in fp32 (vLLM's fused_add_rms_norm). The grid is the rows:
no host sync, so a padded decode step replays it in a CUDA graph.

Semantics:
    rms_norm(x, w, eps, plus_one):          out = rms_norm_ref.rms_norm(x, w, eps, plus_one)
    add_rms_norm(x, r, w, eps, plus_one):   r += x (in place, rounded to r's dtype); out = rms_norm(r, ...)
Shape: x, r [T, H] (rows any stride, last dim contiguous); w [H]; out [T, H]: x's dtype with plus_one,
    else w and x's promoted dtype (as `weight * h.to(x.dtype)` gives).

Reference (runnable):
    r = residual.clone(); r += x
    h = r.float(); h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * w).to(x.dtype) if plus_one else w * h.to(x.dtype)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of a row one chunk holds in registers: 8192 fp32 over 8 warps is 32 a thread. Wider rows
# (hidden 16384) take two chunks, the second pass re-reading the row.
MAX_BLOCK = 8192


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr,
    hidden, eps,
    stride_x, stride_r, stride_o,
    ADD: tl.constexpr, PLUS_ONE: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
):
    """Semantics: see the module doc; ADD: the fused form (r += x first). Shape: grid (T,); x, r, out [T, H]."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    o_row = out_ptr + row * stride_o
    act = r_ptr.dtype.element_ty if ADD else x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        offs = c * BLOCK + cols
        mask = offs < hidden
        s = tl.load(x_row + offs, mask=mask, other=0.0)
        if ADD:
            # The sum rounded to the activation dtype, as `residual += x` stores it, then normed from there.
            s = (s.to(tl.float32) + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)).to(act)
            tl.store(r_row + offs, s, mask=mask)
        h = s.to(tl.float32)
        acc += h * h
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / hidden + eps)
    for c in tl.static_range(CHUNKS):
        offs = c * BLOCK + cols
        mask = offs < hidden
        if CHUNKS == 1:
            hn = h * rstd  # the one chunk's row is still in registers
        elif ADD:
            hn = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32) * rstd  # this thread's own store
        else:
            hn = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32) * rstd
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if PLUS_ONE:
            y = hn * w  # Gemma: the fp32 gain before the cast back
        else:
            y = hn.to(act).to(tl.float32) * w  # Llama: cast back, then times the weight (exact in fp32)
        tl.store(o_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """out = rms_norm(x) * weight (module doc); out allocated when None."""
    return _launch(x, None, weight, eps, plus_one, out)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 plus_one: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """residual += x in place; returns rms_norm(residual) * weight (module doc)."""
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    return _launch(x, residual, weight, eps, plus_one, out)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, plus_one: bool,
            out: torch.Tensor | None) -> torch.Tensor:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("x and residual need a contiguous last dimension")
    act = x.dtype if residual is None else residual.dtype
    dtype = act if plus_one else torch.promote_types(weight.dtype, act)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {tuple(x.shape)} {dtype} with a contiguous last dimension")
    rows, hidden = x.shape
    if rows == 0:
        return out
    block = min(triton.next_power_of_2(hidden), MAX_BLOCK)
    r = x if residual is None else residual  # unread without ADD
    _rms_norm_kernel[(rows,)](
        x, r, weight.contiguous(), out, hidden, eps, x.stride(0), r.stride(0), out.stride(0),
        ADD=residual is not None, PLUS_ONE=plus_one, BLOCK=block, CHUNKS=triton.cdiv(hidden, block),
        num_warps=_warps(block))
    return out


def _warps(block: int) -> int:
    """16 to 32 row elements a thread: 1 warp for a 512-wide row, 8 from 4096."""
    return max(1, min(8, block // 512))
