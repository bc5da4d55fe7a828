"""registry_fetch: how the engine reads a stored version from the Redis registry.

The engine pages adapters Redis -> host -> device itself (adapters.host_tier); it only needs a
callable that turns a version id into a parsed adapter. Built by the server's state in the in-process
mode and by the engine-core process itself in the separate one (server.engine.core).
"""
from __future__ import annotations

from collections.abc import Callable

from adapters.draft_lora import draft_from_bytes, with_draft
from adapters.format import LoraAdapter, ModelShape, load_adapter_bytes, with_heads
from adapters.loader_pool import LoaderPool
from adapters.medusa_format import MAX_ADAPTER_HEADS, check_heads
from adapters.registry import AdapterRegistry


def registry_fetch(registry: AdapterRegistry, shape: ModelShape, max_lora_rank: int,
                   pager: LoaderPool | None = None,
                   draft_shape: ModelShape | None = None) -> Callable[[str], LoraAdapter]:
    """Runs on the engine's loader threads: read the version's files and validate them again, in
    `pager`'s loader process when there is one (parsing and value checks take the interpreter).
    draft_shape: the draft model's, which a version's draft LoRA is checked against again (None: the
    server runs no draft model, and a version stored with one is refused)."""

    def fetch(version: str) -> LoraAdapter:
        config_json, weights = registry.read_files(version)
        if pager is not None:
            adapter = pager.parse(config_json, weights, shape, max_lora_rank, f"stored version {version}")
        else:
            adapter = load_adapter_bytes(config_json, weights, shape, max_lora_rank)
        heads = registry.read_medusa(version)  # its own Medusa heads, checked again as the upload was
        if heads is not None:
            adapter = with_heads(adapter, check_heads(*heads, shape.hidden_size, shape.vocab_size or 0,
                                                      max_heads=MAX_ADAPTER_HEADS))
        draft = registry.read_draft(version)  # its draft LoRA, alike
        if draft is not None:
            adapter = with_draft(adapter, draft_from_bytes(*draft, draft_shape, max_lora_rank))
        return adapter

    return fetch
