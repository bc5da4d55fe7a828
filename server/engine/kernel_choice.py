"""The torch kernel set, and the choice among the implementations the engine makes at start-up."""
from __future__ import annotations

import os
from typing import Callable

import torch

from kernels import attention_ref, lora_cpu, lora_ref
from kernels.cpu_linear import linear, linear_for
from kernels.int4_weights import dequant_int4_linear, int4_linear_for
from kernels.int8_weights import dequant_linear, int8_linear_for
from server.engine.kernel_ops import KernelOps

KERNEL_KINDS = ("auto", "triton", "torch")


def torch_ops(linear: Callable[..., torch.Tensor] = linear,
              int8_linear: Callable[..., torch.Tensor] = dequant_linear,
              int4_linear: Callable[..., torch.Tensor] = dequant_int4_linear) -> KernelOps:
    return KernelOps(
        name="torch",
        lora_shrink=lora_ref.lora_shrink,
        lora_expand=lora_ref.lora_expand,
        lora=lora_cpu.lora_apply,
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
    from server.engine.triton_ops import triton_ops

    return triton_ops()
