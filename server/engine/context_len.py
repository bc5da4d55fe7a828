"""The context length (max_model_len): the one asked for, checked, or, when none was, the largest that
both the model and the KV pool allow.

vLLM takes the model's length and fails at start when the KV pool cannot hold one such sequence; on a
small machine a real checkpoint (SmolLM2: 8192 positions) then needs flags before it serves at all.
Here an unset length shrinks to what the pool holds for MIN_FULL_SEQUENCES sequences of that length,
so a few requests at full length can run together, and one log line says what was chosen and why.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from server.engine.config import ModelConfig

# Sequences of the full context that the KV pool holds at least, when the length is chosen here.
MIN_FULL_SEQUENCES = 4


class ContextLengthError(ValueError):
    """An explicit max_model_len that the model or the KV pool cannot serve."""


def model_limit(mcfg: ModelConfig, requested: int | None) -> int:
    """The longest context the model itself allows; an explicit request past it is refused here, before
    any weights are loaded. A sliding window bounds nothing: each layer applies its own in attention
    (server.engine.sliding_window)."""
    limit = mcfg.max_position_embeddings
    if requested is not None and requested > limit:
        raise ContextLengthError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}")
    return limit


@dataclass(frozen=True)
class ContextChoice:
    max_model_len: int
    reason: str  # one line for the log: what was chosen and why


def choose_max_model_len(requested: int | None, limit: int, num_blocks: int, block_size: int,
                         held: Callable[[int], int] | None = None) -> ContextChoice:
    """`requested` if the pool holds one such sequence (else ContextLengthError); unset, the model's
    `limit` or, if the pool holds fewer than MIN_FULL_SEQUENCES of those, the longest length (a whole
    number of blocks) of which it holds that many (one block, for a pool smaller than that).
    held(length): the most blocks a sequence of that length holds at once (server.engine.sliding_window.
    sequence_blocks: a model windowed in every layer holds its window's); all of its blocks when None."""
    held = held or (lambda length: -(-length // block_size))
    pool_tokens = num_blocks * block_size
    if requested is not None:
        need = held(requested)
        if num_blocks < need:
            raise ContextLengthError(
                f"the KV pool has {num_blocks} blocks of {block_size} tokens but one max_model_len "
                f"({requested}) sequence needs {need}: raise kv_cache_blocks (--kv-cache-blocks, or "
                "--gpu-memory-utilization on a GPU) or lower max_model_len")
        return ContextChoice(requested, f"max_model_len {requested} as given; the KV pool holds "
                                        f"{pool_tokens} tokens ({num_blocks // need} such sequences)")
    if num_blocks >= MIN_FULL_SEQUENCES * held(limit):
        return ContextChoice(limit, f"max_model_len {limit}: the model's limit; the KV pool holds {pool_tokens} "
                                    f"tokens ({num_blocks // held(limit)} such sequences)")
    # A pool of fewer than MIN_FULL_SEQUENCES blocks still serves one block per sequence.
    fitted = min(limit, max(num_blocks // MIN_FULL_SEQUENCES, 1) * block_size)
    if fitted < 2:
        raise ContextLengthError(f"the KV pool holds {pool_tokens} token(s): raise kv_cache_blocks")
    return ContextChoice(fitted, f"max_model_len {fitted} (the model allows {limit}): the KV pool holds "
                                 f"{pool_tokens} tokens, room for {MIN_FULL_SEQUENCES} sequences of {fitted}; "
                                 "set --max-model-len or a larger KV pool to choose otherwise")
