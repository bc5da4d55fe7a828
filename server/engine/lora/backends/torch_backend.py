"""The torch strategy: matmuls grouped by adapter run (kernels.lora_cpu), for CPUs and --kernels torch."""
from __future__ import annotations

from kernels import expert_lora_ref, lora_cpu, lora_ref
from server.engine.lora.backends.base import LoraBackend


class TorchLoraBackend(LoraBackend):
    """apply: long runs by grouped matmuls, short ones (decodes) in batched chunks; shrink and expand:
    the plain-torch reference; apply_experts: one matmul pair per (expert, slot) group."""

    name = "torch"
    shrink = staticmethod(lora_ref.lora_shrink)
    expand = staticmethod(lora_ref.lora_expand)
    apply = staticmethod(lora_cpu.lora_apply)
    apply_experts = staticmethod(expert_lora_ref.expert_lora_apply)  # a matmul pair per (expert, slot) group
