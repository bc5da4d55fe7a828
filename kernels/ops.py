"""One set of kernel entry points per implementation; the engine picks one at start-up."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import attention_ref, lora_ref

KERNEL_KINDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelOps:
    name: str
    lora_shrink: Callable[..., None]  # see kernels.lora_ref.lora_shrink
    lora_expand: Callable[..., None]  # see kernels.lora_ref.lora_expand
    write_kv: Callable[..., None]  # see kernels.attention_ref.write_kv
    paged_attention: Callable[..., None]  # see kernels.attention_ref.paged_attention


def torch_ops() -> KernelOps:
    return KernelOps(
        name="torch",
        lora_shrink=lora_ref.lora_shrink,
        lora_expand=lora_ref.lora_expand,
        write_kv=attention_ref.write_kv,
        paged_attention=attention_ref.paged_attention,
    )


def select_kernels(kind: str, device: torch.device) -> KernelOps:
    """`auto` is Triton on CUDA and the torch reference elsewhere."""
    if kind not in KERNEL_KINDS:
        raise ValueError(f"kernels must be one of {KERNEL_KINDS}, got {kind!r}")
    if kind == "auto":
        kind = "triton" if device.type == "cuda" else "torch"
    if kind == "torch":
        return torch_ops()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels='triton' needs a CUDA device, or TRITON_INTERPRET=1 to run on CPU")
    from kernels.triton_ops import triton_ops

    return triton_ops()
