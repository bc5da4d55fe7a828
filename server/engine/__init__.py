"""Base-model executor with paged KV cache, continuous batching and batched multi-LoRA.

Imports only torch, triton, transformers, safetensors and the standard library
(plus loraplex's own adapters.format and kernels), so it runs where the HTTP
stack and Redis client are not installed.
"""
from server.engine.config import EngineConfig, ModelConfig
from server.engine.engine_stats import EngineStats
from server.engine.llm import LLM
from server.engine.llm_engine import LLMEngine, RequestError
from server.engine.sequence import RequestOutput, SamplingParams
from server.engine.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "EngineStats",
    "ModelConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
