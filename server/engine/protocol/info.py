"""EngineInfo: what the engine is, fixed once it has started."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from adapters.format import ModelShape
from server.engine.config import ModelConfig
from server.engine.kv_cache import KvPoolInfo

if TYPE_CHECKING:
    from server.engine.llm_engine import LLMEngine
    from server.engine.speculative_config import SpeculativeConfig


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
    # The ids that end a choice (the model's and the tokenizer's EOS): a front end that compiles grammars
    # itself (the engine-core mode) builds its vocabulary's stop tokens from them.
    eos_token_ids: tuple[int, ...] = ()
    # Heads an adapter's own Medusa heads must have: the server's num_speculative_tokens with method medusa,
    # else 1 (they are stored for a later medusa server).
    medusa_heads_needed: int = 1
    # What an adapter's draft LoRA must fit (the draft model's widths); None: the server runs no draft model.
    draft_adapter_shape: ModelShape | None = None


def engine_info(engine: LLMEngine) -> EngineInfo:
    cfg = engine.config
    return EngineInfo(
        max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
        adapter_shape=engine.adapter_shape, max_loras=engine.max_loras, max_lora_rank=cfg.lora.max_lora_rank,
        max_num_seqs=cfg.scheduler.max_num_seqs, max_cpu_lora_bytes=engine.host.budget_bytes, device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."), dtype_bytes=engine.dtype.itemsize, kv_pool=engine.kv_pool,
        requested_kv_cache_dtype=cfg.cache.kv_cache_dtype, block_size=cfg.cache.block_size,
        async_scheduling=cfg.scheduler.async_scheduling, base_weights=engine.model.base_weights(),
        model_config=engine.model_config,
        eos_token_ids=tuple(sorted(engine.eos_token_ids)),
        medusa_heads_needed=_medusa_heads_needed(cfg.speculative_config),
        draft_adapter_shape=engine.draft_adapter_shape)


def _medusa_heads_needed(spec: SpeculativeConfig | None) -> int:
    return spec.num_speculative_tokens if spec is not None and spec.method == "medusa" else 1
