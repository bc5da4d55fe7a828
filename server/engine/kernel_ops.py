"""The kernel entry points as one set per implementation (server.engine.kernel_choice for torch and the choice,
server.engine.triton_ops for Triton): what the model calls, whichever set it was given."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.cpu_linear import linear
from kernels.fp8_weights import scaled_mm_linear
from kernels.int4_weights import dequant_int4_linear
from kernels.int8_weights import dequant_linear


@dataclass(frozen=True)
class KernelOps:
    name: str
    lora_shrink: Callable[..., None]  # see kernels.lora_ref.lora_shrink
    lora_expand: Callable[..., None]  # see kernels.lora_ref.lora_expand
    lora: Callable[..., None]  # one fused projection's LoRA, both sides: kernels.lora_cpu / lora_triton.lora_apply
    write_kv: Callable[..., None]  # see kernels.attention_ref.write_kv
    write_kv_padded: Callable[..., None]  # write_kv skipping negative slots: see kernels.attention_ref.write_kv_padded
    paged_attention: Callable[..., None]  # see kernels.attention_ref.paged_attention
    linear: Callable[..., torch.Tensor] = linear  # the base projections, F.linear's semantics (kernels.cpu_linear)
    int8_linear: Callable[..., torch.Tensor] = dequant_linear  # the same on an Int8Weight (kernels.int8_weights)
    fp8_linear: Callable[..., torch.Tensor] = scaled_mm_linear  # the same on an Fp8Weight (kernels.fp8_weights)
    int4_linear: Callable[..., torch.Tensor] = dequant_int4_linear  # the same on an Int4Weight (kernels.int4_weights)

