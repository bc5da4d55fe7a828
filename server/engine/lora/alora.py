"""Activated LoRA in the engine: which of a request's tokens run with its adapter, and which KV is the base's.

A request's *activation point* (`SequenceGroup.adapter_from`) is the first
position its adapter applies to: 0 for a plain LoRA (and irrelevant for the
base model), the start of the invocation sequence's last occurrence in the
prompt for an aLoRA, NOT_INVOKED when the prompt lacks it (PEFT's rule,
adapters.activation). It is found when the request is admitted, the adapter
being in the host tier then, and depends on the prompt alone, so preemption
and forks keep it.

Tokens before the point take the no-adapter slot (-1): they run as base-model
rows in the same batch, whatever chunk they fall in. KV blocks wholly before
it are the base model's, and the prefix cache keys them so
(server.engine.block_manager); blocks from it on are the adapter's, keyed on
its version *and* the point, since the same tokens with the adapter switched
on elsewhere give other K/V.
"""
from __future__ import annotations

from typing import Sequence

from adapters.activation import activation_start, invocation_tokens
from adapters.format import LoraAdapter


def adapter_from(adapter: LoraAdapter, prompt: Sequence[int]) -> int:
    """The activation point of `prompt` under `adapter`: 0 unless it is an aLoRA."""
    invocation = invocation_tokens(adapter.config)
    return 0 if invocation is None else activation_start(invocation, prompt)


def token_slots(slot: int, start: int, n: int, first_active: int) -> list[int]:
    """The adapter slot of each of a sequence's tokens at positions start .. start+n-1 when its adapter
    (in `slot`, -1: none) applies from position `first_active` on; -1 before it."""
    if slot < 0 or first_active <= start:
        return [slot] * n
    base = min(n, first_active - start)
    return [-1] * base + [slot] * (n - base)


def base_blocks(first_active: int, block_size: int) -> int:
    """How many leading full blocks hold only tokens before the activation point: the base model's KV."""
    return first_active // block_size
