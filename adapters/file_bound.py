"""The largest adapter_model.safetensors a server can accept: every module of every layer at the
rank cap, DoRA magnitudes included, and parts of embed_tokens and lm_head (up to --max-lora-vocab-bytes),
in the widest dtype the header allows, plus the largest header.
A fetch reads no more than this of any file or archive member, whatever the operator's byte cap, so
a loader's memory is bounded by the model (a zip of zeros stops here, not at --max-upload-bytes)."""
from __future__ import annotations

from dataclasses import replace

from adapters.format import ModelShape
from adapters.peft_config import PROJECTIONS
from adapters.safetensors_header import DTYPE_BYTES, MAX_HEADER_BYTES
from adapters.sources.policy import SourcePolicy


def max_weights_file_bytes(shape: ModelShape, max_lora_rank: int) -> int:
    widest = max(DTYPE_BYTES.values())
    per_layer = 0
    for proj in PROJECTIONS:
        fan_in, fan_out = shape.in_out(proj)
        per_layer += max_lora_rank * (fan_in + fan_out) + fan_out  # A, B and a DoRA magnitude
    # embed_tokens and lm_head (adapters.vocab_format): a LoRA on each and a full copy of each, at most
    vocab = 0 if shape.vocab_size is None else 2 * (max_lora_rank * (shape.vocab_size + shape.hidden_size)
                                                    + shape.vocab_size * shape.hidden_size)
    if shape.max_vocab_bytes is not None:
        vocab = min(vocab, shape.max_vocab_bytes // 4)  # the bound counts float32 bytes
    return 8 + MAX_HEADER_BYTES + (shape.num_layers * per_layer + vocab) * widest


def bounded_by_model(policy: SourcePolicy, shape: ModelShape, max_lora_rank: int) -> SourcePolicy:
    """`policy` with its per-file cap no larger than the largest adapter file `shape` can take."""
    cap = min(policy.max_file_bytes, max_weights_file_bytes(shape, max_lora_rank))
    return replace(policy, max_file_bytes=cap)
