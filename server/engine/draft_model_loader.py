"""The draft_model method's model, loaded and checked against the target at start.

Any architecture the engine serves (ModelConfig.from_dir refuses the rest), with the target's vocabulary:
a draft token is an id the target scores, so different sizes are refused in one line naming both. Its
weights are served as the checkpoint's floats in the target's dtype; its LoRA buffers are the target's
slot count at --max-lora-rank, for adapters' draft LoRAs (server.engine.lora.draft_slots), holding no memory
until the first draft LoRA loads.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from adapters.format import ModelShape
from server.engine.config import EngineConfig, ModelConfig, ModelConfigError
from server.engine.kv_cache import allocate_lora_slots
from server.engine.lora.draft_slots import DraftLoraSlots
from server.engine.lora.paging import LoraPaging
from server.engine.model import CausalLM
from server.engine.unified_buffer import unallocated
from server.engine.weights import load_weights


def read_draft_config(model_dir: str, target: ModelConfig) -> ModelConfig:
    """The draft's config, refused (ModelConfigError, one line) where it cannot draft for `target`."""
    if not Path(model_dir, "config.json").is_file():
        raise ModelConfigError(f"speculative draft model {model_dir!r} has no config.json")
    if target.kv_window is not None:
        # The draft's KV rides the target's block ids, which a windowed target releases behind its window.
        raise ModelConfigError(f"speculative method draft_model is not supported for a target with a sliding "
                               f"window in every layer ({target.architecture}, window {target.kv_window})")
    draft = ModelConfig.from_dir(model_dir)
    for model in (target, draft):  # its pool rides group 0's block ids: one tensor per layer of all of them
        if model.kv_groups is not None:
            raise ModelConfigError(f"speculative method draft_model is not supported with sliding-window layers "
                                   f"interleaved with global ones ({model.architecture}: KV layer groups)")
    if draft.vocab_size != target.vocab_size:
        raise ModelConfigError(f"speculative draft model's vocabulary ({draft.vocab_size} tokens) does not match "
                               f"the target's ({target.vocab_size} tokens)")
    return draft


def load_draft_model(model_dir: str, draft: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int,
                     max_tokens: int, max_loras: int, max_lora_rank: int) -> tuple[CausalLM, DraftLoraSlots]:
    """The draft model and its LoRA slots, one per target slot. max_tokens: the most tokens one draft
    forward takes (its catch-up is cut to it)."""
    weights = load_weights(model_dir, draft, dtype, device)
    # Stand-ins until an adapter brings a draft LoRA; no DoRA scale rows (draft LoRAs are plain LoRA).
    paging = dataclasses.replace(LoraPaging.slots(max_loras, max_lora_rank), dora_entries=0)
    layers = allocate_lora_slots(draft, max_loras, max_lora_rank, dtype, device, paging, unallocated, unallocated)
    return CausalLM(draft, weights, layers, max_len, max_tokens), DraftLoraSlots(layers, max_loras)


def draft_adapter_shape(config: EngineConfig) -> ModelShape | None:
    """What an adapter's draft LoRA (adapters.draft_lora) must fit: the draft model's widths, read from its
    config.json as the front end reads the target's; None without a draft model. The engine and every
    fetch of a stored version read it here, so all check a draft LoRA against the same shape."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    return ModelShape.from_hf_config(json.loads(Path(spec.model, "config.json").read_text()))
