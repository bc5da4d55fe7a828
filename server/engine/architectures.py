"""The architectures loraplex serves, and what each supports: the registry a model's config.json is
checked against at start (server.engine.config), anything else refused there in one line naming it."""
from __future__ import annotations

from dataclasses import dataclass

from server.engine.gemma_config import GEMMA_ARCHS
from server.engine.moe_config import MOE_ARCHS


@dataclass(frozen=True)
class ArchSupport:
    """What an architecture is served with."""

    quantization: bool  # --quantization int8/int4/fp8 (and GPTQ checkpoints)
    dora: str  # which modules a DoRA adapter may target: "all", or "attention" (MoE: not the experts)
    sliding_window: bool  # windowed attention layers (Mistral, Qwen's use_sliding_window, Gemma's)
    moe: bool  # experts routed top-k, LoRA on them by PEFT's target_parameters or per-expert Linear (transformers 4)
    gguf: bool  # a llama.cpp GGUF file of it converts (server.gguf_convert)


_DENSE = ArchSupport(quantization=True, dora="all", sliding_window=True, moe=False, gguf=True)
ARCHITECTURES: dict[str, ArchSupport] = {
    "LlamaForCausalLM": _DENSE,
    "MistralForCausalLM": _DENSE,
    "Qwen2ForCausalLM": _DENSE,
    "Qwen3ForCausalLM": _DENSE,
    "Phi3ForCausalLM": _DENSE,
    **{arch: _DENSE for arch in GEMMA_ARCHS},
    **{arch: ArchSupport(quantization=False, dora="attention", sliding_window=True, moe=True, gguf=False)
       for arch in MOE_ARCHS},
}
SUPPORTED_ARCHS = tuple(ARCHITECTURES)


def architecture_refusal(arch: str) -> str:
    """The one line an unserved architecture is refused with."""
    return f"architecture {arch} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
