"""The kernel sets (torch, Triton), and the choice between them the engine makes at start-up."""
from __future__ import annotations

import os
from typing import Callable

import torch

from kernels import attention_ref
from kernels.cpu_linear import linear, linear_for
from kernels.int4_weights import dequant_int4_linear, int4_linear_for
from kernels.int8_weights import dequant_linear, int8_linear_for
from server.engine.kernel_ops import KernelOps
from server.engine.lora.backends.torch_backend import TorchLoraBackend

KERNEL_KINDS = ("auto", "triton", "torch")


def torch_ops(linear: Callable[..., torch.Tensor] = linear,
              int8_linear: Callable[..., torch.Tensor] = dequant_linear,
              int4_linear: Callable[..., torch.Tensor] = dequant_int4_linear) -> KernelOps:
    return KernelOps(
        name="torch",
        lora=TorchLoraBackend(),
        write_kv=attention_ref.write_kv,
        write_kv_padded=attention_ref.write_kv_padded,
        paged_attention=attention_ref.paged_attention,
        linear=linear,
        int8_linear=int8_linear,
        int4_linear=int4_linear,
    )


def select_kernels(kind: str, device: torch.device, dtype: torch.dtype = torch.float32,
                   quantization: str | None = None) -> KernelOps:
    """`auto` is Triton on CUDA and the torch reference elsewhere; on a CPU without native
    half-precision matmuls, half-precision projections compute in float32 (kernels.cpu_linear).
    The int8 or int4 matmul is chosen (and its AVX2 kernel built) only for quantization "int8" or "int4"."""
    if kind not in KERNEL_KINDS:
        raise ValueError(f"kernels must be one of {KERNEL_KINDS}, got {kind!r}")
    if kind == "auto":
        kind = "triton" if device.type == "cuda" else "torch"
    if kind == "torch":
        int8_linear = int8_linear_for(device, dtype) if quantization == "int8" else dequant_linear
        int4_linear = int4_linear_for(device, dtype) if quantization == "int4" else dequant_int4_linear
        return torch_ops(linear_for(device, dtype), int8_linear, int4_linear)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels='triton' needs a CUDA device, or TRITON_INTERPRET=1 to run on CPU")
    return triton_ops()


def triton_ops() -> KernelOps:
    """Triton kernels; tensors on CUDA, or on CPU under TRITON_INTERPRET=1. Imported only when chosen."""
    from kernels import attention_triton, int4_triton, int8_triton, rms_norm_triton
    from server.engine.lora.backends.triton_backend import TritonLoraBackend

    return KernelOps(
        name="triton",
        lora=TritonLoraBackend(),
        write_kv=attention_triton.write_kv,
        write_kv_padded=attention_triton.write_kv,  # skips negative slots already
        paged_attention=attention_triton.paged_attention,
        int8_linear=int8_triton.int8_linear,  # reads the int8 weight in place (kernels.int8_triton)
        int4_linear=int4_triton.int4_triton_linear,  # unpacks the int4 weight in registers (kernels.int4_triton)
        rms_norm=rms_norm_triton.rms_norm,  # one launch a norm, not 6-8 (kernels.rms_norm_triton)
        add_rms_norm=rms_norm_triton.add_rms_norm,  # and the residual add before it in the same launch
    )
