"""Base-model executor with paged KV cache, continuous batching and batched multi-LoRA.

Imports only torch, triton, transformers, safetensors and the standard library
(plus loraplex's own adapters.format and kernels), so it runs where the HTTP
stack and Redis client are not installed. The names below load on first use (PEP 562): importing
server.engine.config, which the front end and the CLI do, must not load torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.engine.config import EngineConfig, ModelConfig
    from server.engine.engine_stats import EngineStats
    from server.engine.llm import LLM
    from server.engine.llm_engine import LLMEngine, RequestError
    from server.engine.sequence import RequestOutput, SamplingParams
    from server.engine.structured_outputs import StructuredOutputsParams

_HOMES = {
    "EngineConfig": "server.engine.config",
    "ModelConfig": "server.engine.config",
    "EngineStats": "server.engine.engine_stats",
    "LLM": "server.engine.llm",
    "LLMEngine": "server.engine.llm_engine",
    "RequestError": "server.engine.llm_engine",
    "RequestOutput": "server.engine.sequence",
    "SamplingParams": "server.engine.sequence",
    "StructuredOutputsParams": "server.engine.structured_outputs",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'server.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
