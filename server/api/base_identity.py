"""Which base model an adapter belongs to.

A stored version records the base it was validated against: `NAME@FINGERPRINT`, the served model
name and a hash of the config fields that decide what a LoRA delta means (architecture and every
dimension; not the checkpoint's dtype, nor its context length). A data dir (a Redis) reused under
another `--model` keeps the old base's adapters: they stay stored and listed (so their tenant sees
them and can delete or upload again) with why they cannot be used, and a request for one is a 400
that names the adapter and both bases, never a retryable 503. A version stored before bases were
recorded (`base` empty) is validated against the served base on its first use and claims it
(server.api.adapter_references).

An upload's `base_model_name_or_path` is only a name (a hub id here, a local directory there), so one
that disagrees with the served model is a warning in the upload's answer, or a refusal under
`--strict-adapter-base`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import PurePosixPath

from adapters.bounded_json import JsonLimitError, loads_bounded
from adapters.registry import AdapterRecord
from server.api.errors import APIError

# Fields of server.engine.config.ModelConfig that do not change what an adapter's delta means (the
# windows neither: a Mistral base read before layer_windows existed keeps its fingerprint).
_NOT_IDENTITY = ("checkpoint_dtype", "eos_token_ids", "max_position_embeddings", "sliding_window", "layer_windows")


def base_identity(model_id: str, model_config) -> str:
    """`NAME@FINGERPRINT` of the served base (model_config: server.engine.config.ModelConfig)."""
    fields = {k: v for k, v in dataclasses.asdict(model_config).items() if k not in _NOT_IDENTITY}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    return f"{model_id}@{digest[:12]}"


def _describe(identity: str) -> str:
    name, _, fingerprint = identity.rpartition("@")
    return f"'{name}' (config {fingerprint})"


def unavailable_reason(record: AdapterRecord, served: str) -> str | None:
    """Why `record` cannot be used on the `served` base; None when it can."""
    if not record.base or record.base == served:
        return None
    return (f"adapter '{record.name}' was validated against base model {_describe(record.base)}, and this "
            f"server serves {_describe(served)}: upload it again to use it with this model, or serve that "
            f"model")


def require_same_base(record: AdapterRecord, served: str) -> AdapterRecord:
    """`record`, or the 400 that says whose base it is."""
    reason = unavailable_reason(record, served)
    if reason is not None:
        raise APIError(400, reason, "adapter_base_mismatch", param="model")
    return record


def listed(record: AdapterRecord, served: str) -> dict:
    """The adapter's public fields, with `available` and, when false, `unavailable_reason`."""
    reason = unavailable_reason(record, served)
    out = {"object": "adapter", **record.public(), "available": reason is None}
    if reason is not None:
        out["unavailable_reason"] = reason
    return out


def declared_base_problem(config_json: bytes, model_id: str, model_path: str | None) -> str | None:
    """A warning when adapter_config.json's `base_model_name_or_path` names another model. Names are
    compared by their last path component, case-insensitively: `HuggingFaceTB/SmolLM2-135M-Instruct`
    (a hub id) and `/models/SmolLM2-135M-Instruct` (a local dir) are the same model. A config that does
    not parse is left to the upload's validation, which says why."""
    try:
        declared = loads_bounded(config_json).get("base_model_name_or_path")
    except (JsonLimitError, ValueError, AttributeError):
        return None
    if not isinstance(declared, str) or not declared.strip():
        return None
    served = {model_id.lower()}
    if model_path:
        served.add(PurePosixPath(model_path).name.lower().removesuffix(".gguf"))
    if PurePosixPath(declared.strip().rstrip("/")).name.lower() in served:
        return None
    return (f"adapter_config.json declares base_model_name_or_path '{declared}', and this server serves "
            f"'{model_id}': outputs are right only if the adapter was trained on this model's weights")
