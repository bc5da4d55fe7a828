"""vLLM's --speculative-config, parsed and checked at start: which draft method, and its knobs.

`ngram` (prompt lookup, server.engine.ngram_proposer), `medusa` (heads over the target's hidden state
from `"model": DIR`, server.engine.medusa_heads) and `draft_model` (a smaller model with the target's
vocabulary from `"model": DIR`, server.engine.draft_model_proposer) are served; every other method, and every key the method
does not read, is refused in one line naming it, so a config written for vLLM never silently runs
something else.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

METHODS = ("ngram", "medusa", "draft_model")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
# The keys each method reads.
_MODEL_KEYS = ("method", "num_speculative_tokens", "model", "disable_by_batch_size")
_METHOD_KEYS = {"ngram": _KEYS, "medusa": _MODEL_KEYS, "draft_model": _MODEL_KEYS}
# What "model" names, per method that reads it.
_MODEL_IS = {"medusa": "the directory of its heads", "draft_model": "the draft model's directory"}
# One verify step scores k + 1 positions per sequence: past a few dozen drafts a miss costs more than
# any hit could save.
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_LOOKUP = 5
# disable_by_batch_size when not given, by device type: the running batch size from which a step
# speculates no more. On a CPU the forward costs about its tokens' compute once a step has a few
# dozen, so k + 1 positions per sequence cost a batch of 8 more than a rarely-accepted workload's drafts
# save (docs/speculative-decoding.md, "Benchmark"); a GPU's decode step is bound by reading the weights
# until far more tokens.
AUTO_DISABLE_BY_BATCH_SIZE = {"cpu": 8, "cuda": 32}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts proposed per sequence and step
    prompt_lookup_max: int  # the longest suffix matched
    prompt_lookup_min: int  # the shortest
    # medusa: the heads' directory (server.engine.medusa_heads; None: the default model's packaged heads,
    # server.default_model.medusa_heads_dir); draft_model: the draft model's
    model: str | None = None
    # vLLM's: no step speculates while this many sequences run; None until the engine picks it for its
    # device (resolve_disable_by_batch_size).
    disable_by_batch_size: int | None = None


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A JSON object (the flag's text) or a dict (the Python API) -> the config; raises ValueError in one line."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise ValueError("speculative config must be a JSON object")
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative method {method!r} is not supported; supported: {', '.join(METHODS)}")
    keys = _METHOD_KEYS[method]
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"speculative config key {unknown[0]!r} is not supported by method {method}; "
                         f"supported: {', '.join(keys)}")
    k = _positive(value, "num_speculative_tokens", None)
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative config num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}")
    cutoff = value.get("disable_by_batch_size")
    if cutoff is not None and _positive(value, "disable_by_batch_size", None) < 2:
        raise ValueError("speculative config disable_by_batch_size must be >= 2")
    if method in _MODEL_IS:
        model = value.get("model")
        if method == "medusa" and model is None:  # the default model's packaged heads (server.default_model)
            return SpeculativeConfig(method, k, DEFAULT_LOOKUP, DEFAULT_LOOKUP, None, cutoff)
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative method {method} needs \"model\": {_MODEL_IS[method]}")
        return SpeculativeConfig(method, k, DEFAULT_LOOKUP, DEFAULT_LOOKUP, model, cutoff)
    # vLLM's defaults: one bound given is both; neither, 5.
    given = value.get("prompt_lookup_max", value.get("prompt_lookup_min", DEFAULT_LOOKUP))
    lookup_max = _positive(value, "prompt_lookup_max", given)
    lookup_min = _positive(value, "prompt_lookup_min", lookup_max)
    if lookup_min > lookup_max:
        raise ValueError("speculative config prompt_lookup_min must be <= prompt_lookup_max")
    return SpeculativeConfig(method, k, lookup_max, lookup_min, disable_by_batch_size=cutoff)


def resolve_disable_by_batch_size(config: SpeculativeConfig | None, device_type: str) -> SpeculativeConfig | None:
    """The config with disable_by_batch_size set: as given, else AUTO_DISABLE_BY_BATCH_SIZE's for the device."""
    if config is None or config.disable_by_batch_size is not None:
        return config
    return replace(config, disable_by_batch_size=AUTO_DISABLE_BY_BATCH_SIZE.get(device_type, 32))


def _positive(value: dict[str, Any], key: str, default: int | None) -> int:
    n = value.get(key, default)
    if n is None:
        raise ValueError(f"speculative config needs {key}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"speculative config {key} must be a positive integer, got {n!r}")
    return n
