"""The Triton strategy: gathered (BGMV) and segmented (SGMV) launches by the step's plan (kernels.lora_triton)."""
from __future__ import annotations

from kernels import expert_lora_triton, lora_triton
from server.engine.lora.backends.base import LoraBackend


class TritonLoraBackend(LoraBackend):
    """Tensors on CUDA, or on CPU under TRITON_INTERPRET=1. The launch plan picks, per run, the gathered
    or the segmented form and whether the shrink splits K (kernels.metadata): per step, not per engine,
    so they are one strategy here. apply also takes `splits` (None: the plan's; 1, 2, 4, 8 forced)."""

    name = "triton"
    shrink = staticmethod(lora_triton.lora_shrink)
    expand = staticmethod(lora_triton.lora_expand)
    apply = staticmethod(lora_triton.lora_apply)
    apply_experts = staticmethod(expert_lora_triton.expert_lora_apply)
