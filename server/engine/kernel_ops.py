"""The kernel entry points the model calls, one set per implementation, picked at start-up
(server.engine.kernel_choice): the LoRA strategy, the KV writes and paged attention, the projections,
the RMSNorms (with the residual add before them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.cpu_linear import linear
from kernels.fp8_weights import scaled_mm_linear
from kernels.int4_weights import dequant_int4_linear
from kernels.int8_weights import dequant_linear
from kernels.rms_norm_ref import add_rms_norm, rms_norm
from server.engine.lora.backends.base import LoraBackend


@dataclass(frozen=True)
class KernelOps:
    name: str
    lora: LoraBackend  # the adapters' shrink/expand (server.engine.lora.backends)
    write_kv: Callable[..., None]  # see kernels.attention_ref.write_kv
    write_kv_padded: Callable[..., None]  # write_kv skipping negative slots: see kernels.attention_ref.write_kv_padded
    paged_attention: Callable[..., None]  # see kernels.attention_ref.paged_attention
    linear: Callable[..., torch.Tensor] = linear  # the base projections, F.linear's semantics (kernels.cpu_linear)
    int8_linear: Callable[..., torch.Tensor] = dequant_linear  # the same on an Int8Weight (kernels.int8_weights)
    fp8_linear: Callable[..., torch.Tensor] = scaled_mm_linear  # the same on an Fp8Weight (kernels.fp8_weights)
    int4_linear: Callable[..., torch.Tensor] = dequant_int4_linear  # the same on an Int4Weight (kernels.int4_weights)
    rms_norm: Callable[..., torch.Tensor] = rms_norm  # (x, weight, eps, plus_one) -> normed rows (kernels.rms_norm_ref)
    add_rms_norm: Callable[..., torch.Tensor] = add_rms_norm  # the same after residual += x in place
