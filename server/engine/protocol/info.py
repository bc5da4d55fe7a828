"""EngineInfo: what the engine is, fixed once it has started."""
from __future__ import annotations

from dataclasses import dataclass

from adapters.format import ModelShape
from server.engine.config import ModelConfig
from server.engine.kv_cache import KvPoolInfo


@dataclass(frozen=True)
class EngineInfo:
    """Read by the front end for validation (lengths, vocabulary, adapter shapes and budgets) and by
    /version and /admin/engine. Frozen dataclasses of primitives: a transport sends it once, at start."""

    max_model_len: int
    vocab_size: int  # the model's (logits') vocabulary: token ids must be below it
    adapter_shape: ModelShape  # the dimensions an adapter must fit
    max_loras: int  # device slots
    max_lora_rank: int
    max_num_seqs: int
    max_cpu_lora_bytes: int | None  # the host tier's budget; None: unbounded
    device: str  # e.g. "cpu", "cuda:0"
    dtype: str  # the serving dtype, e.g. "bfloat16"
    dtype_bytes: int  # its itemsize
    kv_pool: KvPoolInfo
    requested_kv_cache_dtype: str  # --kv-cache-dtype as given ("auto" or a name)
    block_size: int
    async_scheduling: bool
    base_weights: dict  # what the projections and lm_head are stored as (CausalLM.base_weights)
    model_config: ModelConfig  # the checkpoint's architecture and dimensions (frozen, primitives)
