"""LoraConfig: the device's adapter slots or pages, pinning, and the host tier's budget."""
from __future__ import annotations

from dataclasses import dataclass

from server.engine.config.checks import check_at_least, check_bools
from server.engine.lora.paging import check_page_rows

MAX_LORA_RANK = 512


@dataclass(frozen=True)
class LoraConfig:
    # Adapter slots; None: sized from memory on CUDA (server.engine.lora.slot_budget), 8 elsewhere.
    max_loras: int | None = None
    max_lora_rank: int = 64
    # Adapter memory by rank (server.engine.lora.paging): pages of this many rank rows, an adapter holding
    # ceil(rank / rows) of them in max_loras slots' worth of memory; None: slots of max_lora_rank rows.
    lora_page_rows: int | None = None
    # KV blocks and adapter pages from one pool (server.engine.unified_memory); needs lora_page_rows.
    unified_memory: bool = False
    # Adapters one tenant may pin on the device (never evicted: LLMEngine.pin_adapter).
    max_pinned_adapters_per_tenant: int = 4
    # The host tier's budget for adapters loaded on demand: bytes (None: unbounded), or vLLM's
    # --max-cpu-loras, room for this many adapters of max_lora_rank on every projection in the serving
    # dtype, which only the loaded model can turn into bytes (LoraConfig.host_budget_bytes); one or the other.
    max_cpu_lora_bytes: int | None = None
    max_cpu_loras: int | None = None
    # The most bytes (float32) of an adapter's parts of embed_tokens and lm_head (adapters.vocab_format);
    # None: no bound below two full copies of the base's.
    max_lora_vocab_bytes: int | None = None

    def __post_init__(self) -> None:
        check_at_least(self, 1, "max_loras", "max_lora_rank", "max_cpu_loras")
        check_at_least(self, 0, "max_pinned_adapters_per_tenant", "max_cpu_lora_bytes", "max_lora_vocab_bytes")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK}, got {self.max_lora_rank}: "
                             f"pass max_lora_rank {MAX_LORA_RANK} or less")
        if self.lora_page_rows is not None:
            check_page_rows(self.lora_page_rows, self.max_lora_rank)
        check_bools(self, "unified_memory")
        if self.unified_memory and self.lora_page_rows is None:
            raise ValueError("unified_memory needs lora_page_rows: adapter pages are what shares the pool with KV")
        if self.max_cpu_loras is not None and self.max_cpu_lora_bytes is not None:
            raise ValueError("max_cpu_loras and max_cpu_lora_bytes both bound the host tier: give one")

    def host_budget_bytes(self, max_adapter_bytes: int) -> int | None:
        """The host tier's budget, given the bytes of one adapter of max_lora_rank on the loaded model."""
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras * max_adapter_bytes
        return self.max_cpu_lora_bytes
