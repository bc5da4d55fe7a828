"""The Triton implementation of the kernel entry points (see server.engine.kernel_ops)."""
from __future__ import annotations

from kernels import attention_triton, int4_triton, int8_triton, lora_triton
from server.engine.kernel_ops import KernelOps


def triton_ops() -> KernelOps:
    """Triton kernels; tensors on CUDA, or on CPU under TRITON_INTERPRET=1."""
    return KernelOps(
        name="triton",
        lora_shrink=lora_triton.lora_shrink,
        lora_expand=lora_triton.lora_expand,
        lora=lora_triton.lora_apply,  # the gathered shrink split over K where the plan says so
        write_kv=attention_triton.write_kv,
        write_kv_padded=attention_triton.write_kv,  # skips negative slots already
        paged_attention=attention_triton.paged_attention,
        int8_linear=int8_triton.int8_linear,  # reads the int8 weight in place (kernels.int8_triton)
        int4_linear=int4_triton.int4_triton_linear,  # unpacks the int4 weight in registers (kernels.int4_triton)
    )
