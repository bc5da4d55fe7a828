"""Which layers attend through a sliding window (outside Gemma's, server.engine.gemma_config), and
the window past which no layer reads a sequence's KV again.

As transformers 5 computes the mask (masking_utils.sliding_window_overlay): a query at position p
sees the keys p - window < k <= p, the window counting the query's own. Mistral, Mixtral, Phi-3 and
Qwen3-MoE window every layer when their config has one (Qwen3-MoE when use_sliding_window says so);
Qwen2 and Qwen3 window the layers its layer_types say, by default those from max_window_layers on;
Llama has no window.
"""
from __future__ import annotations

from typing import Any

# A config's sliding_window applies to every layer.
EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM")
# use_sliding_window turns it on (false unless set), for the layers of layer_types / max_window_layers.
BY_LAYER_TYPE = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Opt in by use_sliding_window.
OPT_IN = BY_LAYER_TYPE + ("Qwen3MoeForCausalLM",)


class SlidingWindowError(ValueError):
    """A window loraplex cannot apply exactly."""


def window_of(cfg: dict[str, Any], arch: str) -> int | None:
    """The config's window, where its architecture applies one (None: no window)."""
    if arch not in EVERY_LAYER + BY_LAYER_TYPE:
        return None
    if arch in OPT_IN and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    if window is not None and window < 1:
        raise SlidingWindowError(f"sliding_window {window} is not a positive number of tokens")
    return window


def layer_windows(cfg: dict[str, Any], arch: str) -> tuple[int | None, ...] | None:
    """Each layer's window (None: a global layer), or None when no layer has one."""
    window = window_of(cfg, arch)
    if window is None:
        return None
    n = cfg["num_hidden_layers"]
    if arch in EVERY_LAYER:
        return (window,) * n
    types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28)
                                       else "full_attention" for i in range(n)]
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else None


def kv_window(windows: tuple[int | None, ...] | None) -> int | None:
    """The widest window when every layer has one: KV wholly more than that far behind a sequence's
    next query is never read again and its blocks can go back to the pool. None when some layer is
    global (it reads every position), or none is windowed."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def sequence_blocks(length: int, block_size: int, window: int | None, chunk: int) -> int:
    """The most KV blocks one sequence of `length` tokens holds at once: all of its own without a
    kv_window; with one, at most the window behind its step's first query and a step's `chunk` of
    new tokens (max_num_batched_tokens), a partial block at each end."""
    whole = -(-length // block_size)
    if window is None:
        return whole
    return min(whole, -(-(window - 1 + chunk) // block_size) + 1)
