"""SchedulerConfig: how much one step may do (sequences, tokens, the prompt cap while decoding), the
context bound, async scheduling, and structured output's mask budgets."""
from __future__ import annotations

from dataclasses import dataclass

from server.engine.config.checks import check_at_least, check_bools

# One step's tokens at most. Kernel offsets are int64, so this is not about overflow: it bounds one
# step's activations (Llama-3-8B's gate_up output alone is 3.8 GB at this many bf16 tokens) and the
# LoRA scratch allocated up front ([3, tokens, max_lora_rank]), and keeps every launch grid's y and z
# within CUDA's 65535. Prefill is chunked, so a larger budget buys nothing: a few thousand tokens per
# step already saturate an H100.
MAX_NUM_BATCHED_TOKENS = 65536
# max_prefill_tokens_while_decoding "auto": CPU_PREFILL_CAP on a CPU, off on a GPU (where a long prompt's
# step costs the others milliseconds, not seconds); resolved by device type when the engine starts.
AUTO_PREFILL_CAP = "auto"
# On a 2-core CPU a 256-token chunk of the demo model's prompt keeps a decoding stream's worst gap under a
# second where one 2,048-token step stalled it for ~6 s (docs/benchmarks/abuse.md).
CPU_PREFILL_CAP = 256
# ... and under it, a step with prompt work costs at most this times a decode-only step, from the engine's
# measured step times (server.engine.step_latency), as Sarathi-Serve sizes its token budget from the TBT SLO.
CPU_PREFILL_STEP_RATIO = 1.25


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's, or what the KV pool holds (server.engine.context_len)
    # Prompt tokens one step may compute while other sequences decode (server.engine.scheduler); None:
    # no cap beyond max_num_batched_tokens; AUTO_PREFILL_CAP: by device type.
    max_prefill_tokens_while_decoding: int | str | None = None
    # Under that cap, a step with prompt work costs at most this times a decode-only step, from measured step
    # times (server.engine.step_latency; `auto`'s on a CPU); None: the cap alone.
    max_prefill_step_ratio: float | None = None
    # vLLM's --async-scheduling: the host schedules and prepares decode step N+1 while step N runs
    # (server.engine.async_step says which steps overlap); off: every step synchronous.
    async_scheduling: bool = False
    # Structured output's mask budget per constrained request (server.engine.mask_lane): the CPU time one
    # token's mask may take, and all its choices' masks together; past either, the request ends with an error
    # naming its constraint. Masks are filled off the step either way: these bound what one request costs.
    max_mask_fill_seconds: float = 1.0
    max_mask_seconds_per_request: float = 60.0

    def __post_init__(self) -> None:
        check_at_least(self, 1, "max_num_seqs", "max_num_batched_tokens")
        check_at_least(self, 2, "max_model_len")
        if self.max_num_batched_tokens > MAX_NUM_BATCHED_TOKENS:
            raise ValueError(f"max_num_batched_tokens must be <= {MAX_NUM_BATCHED_TOKENS}, "
                             f"got {self.max_num_batched_tokens}")
        cap = self.max_prefill_tokens_while_decoding
        if cap != AUTO_PREFILL_CAP:
            check_at_least(self, 1, "max_prefill_tokens_while_decoding")
        if self.max_prefill_step_ratio is not None and not (
                self.max_prefill_step_ratio > 1 and cap not in (None, AUTO_PREFILL_CAP)):
            raise ValueError("max_prefill_step_ratio must be > 1, under a max_prefill_tokens_while_decoding "
                             "given as a number (auto sets its own)")
        check_bools(self, "async_scheduling")
        for name in ("max_mask_fill_seconds", "max_mask_seconds_per_request"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    def prefill_cap_for(self, device_type: str) -> int | None:
        """max_prefill_tokens_while_decoding on this device type."""
        if self.max_prefill_tokens_while_decoding == AUTO_PREFILL_CAP:
            return CPU_PREFILL_CAP if device_type == "cpu" else None
        return self.max_prefill_tokens_while_decoding

    def prefill_step_ratio_for(self, device_type: str) -> float | None:
        """The latency-aware bound under that cap: auto's on a CPU only; an explicit one as given."""
        if self.max_prefill_tokens_while_decoding == AUTO_PREFILL_CAP:
            return CPU_PREFILL_STEP_RATIO if device_type == "cpu" else None
        return self.max_prefill_step_ratio
