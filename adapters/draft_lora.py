"""An adapter's own LoRA for the server's draft model (speculative method `draft_model`).

The draft model is a smaller CausalLM with the target's vocabulary; a tenant's adapter changes what the
target says, so drafts from the base draft model are rejected more often on its requests. An adapter may
carry a PEFT adapter for the draft model in a `draft/` folder beside its own PEFT files (the same two
files), or as the upload's form files `draft_adapter_config.json` and `draft_adapter_model.safetensors`:
its requests' drafts then run with it (server.engine.lora.draft_slots), the rest of the batch on the base
draft model. It is checked against the draft model's shapes as any adapter is against the target's, under
the same rank cap, and refused where the server runs no draft model. DoRA and parts of embed_tokens or
lm_head are refused: the draft's slots hold plain LoRA only.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from adapters.format import (CONFIG_FILE, WEIGHTS_FILE, AdapterFormatError, LoraAdapter, ModelShape,
                             load_adapter_bytes, load_adapter_dir)

ADAPTER_DIR = "draft"  # an adapter's draft LoRA: this folder beside its PEFT files
FILES = (CONFIG_FILE, WEIGHTS_FILE)  # the folder's files
FORM_FILES = tuple(f"draft_{name}" for name in FILES)  # the upload's optional form files, in FILES' order
NO_DRAFT_MODEL = ("the adapter carries a draft LoRA, but this server runs no draft model "
                  "(--speculative-config method draft_model)")


def check_draft(draft: LoraAdapter, source: str) -> LoraAdapter:
    """`draft` if the draft model's slots can serve it (plain LoRA on its projections)."""
    if draft.use_dora:
        raise AdapterFormatError(f"{source}: a draft LoRA with use_dora is not supported (the draft model's "
                                 f"slots hold plain LoRA)")
    if draft.vocab is not None:
        raise AdapterFormatError(f"{source}: a draft LoRA on embed_tokens or lm_head is not supported")
    return draft


def read_draft_dir(adapter_dir: str | Path, draft_shape: ModelShape | None, max_lora_rank: int,
                   max_bytes: int | None = None) -> LoraAdapter | None:
    """An adapter directory's draft LoRA (its `draft/` folder), checked against the draft model; None without."""
    d = Path(adapter_dir).expanduser() / ADAPTER_DIR
    if not d.exists():
        return None
    if draft_shape is None:
        raise AdapterFormatError(f"{adapter_dir}: {NO_DRAFT_MODEL}")
    source = f"{adapter_dir}: the adapter's {ADAPTER_DIR}/ folder"
    try:
        draft = load_adapter_dir(d, draft_shape, max_lora_rank, max_bytes=max_bytes)
    except AdapterFormatError as e:
        raise AdapterFormatError(f"{source}: {e}") from None
    if draft.medusa is not None:
        raise AdapterFormatError(f"{source} holds medusa heads: they go beside the adapter's own PEFT files")
    return check_draft(draft, source)


def draft_from_bytes(config_json: bytes, weights: bytes, draft_shape: ModelShape | None,
                     max_lora_rank: int, max_bytes: int | None = None) -> LoraAdapter:
    """An upload's (or a stored version's) draft LoRA files, checked against the draft model."""
    if draft_shape is None:
        raise AdapterFormatError(NO_DRAFT_MODEL)
    try:
        draft = load_adapter_bytes(config_json, weights, draft_shape, max_lora_rank, max_bytes=max_bytes)
    except AdapterFormatError as e:
        raise AdapterFormatError(f"draft LoRA: {e}") from None
    return check_draft(draft, "draft LoRA")


def with_draft(adapter: LoraAdapter, draft: LoraAdapter | None) -> LoraAdapter:
    """`adapter` carrying its draft LoRA, whose bytes count in its size_bytes (the host tier's budget)."""
    if draft is None:
        return adapter
    return dataclasses.replace(adapter, draft=draft, size_bytes=adapter.size_bytes + draft.size_bytes)


def load_adapter_with_draft(path: str | Path, shape: ModelShape, draft_shape: ModelShape | None,
                            max_lora_rank: int) -> LoraAdapter:
    """load_adapter_dir() and the directory's draft LoRA with it (refused where `draft_shape` is None)."""
    adapter = load_adapter_dir(path, shape, max_lora_rank)
    return with_draft(adapter, read_draft_dir(path, draft_shape, max_lora_rank))
