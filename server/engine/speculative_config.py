"""vLLM's --speculative-config, parsed and checked at start: which draft method, and its knobs.

`ngram` (prompt lookup, server.engine.ngram_proposer) and `medusa` (heads over the target's hidden state
from `"model": DIR`, server.engine.medusa_heads) are served; every other method, and every key the method
does not read, is refused in one line naming it, so a config written for vLLM never silently runs
something else.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "medusa")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
# The keys each method reads.
_METHOD_KEYS = {"ngram": _KEYS, "medusa": ("method", "num_speculative_tokens", "model")}
# One verify step scores k + 1 positions per sequence: past a few dozen drafts a miss costs more than
# any hit could save.
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts proposed per sequence and step
    prompt_lookup_max: int  # the longest suffix matched
    prompt_lookup_min: int  # the shortest
    model: str | None = None  # medusa: the heads' directory (server.engine.medusa_heads)


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
    if method == "medusa":
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative method medusa needs \"model\": the directory of its heads")
        return SpeculativeConfig(method, k, DEFAULT_LOOKUP, DEFAULT_LOOKUP, model)
    # vLLM's defaults: one bound given is both; neither, 5.
    given = value.get("prompt_lookup_max", value.get("prompt_lookup_min", DEFAULT_LOOKUP))
    lookup_max = _positive(value, "prompt_lookup_max", given)
    lookup_min = _positive(value, "prompt_lookup_min", lookup_max)
    if lookup_min > lookup_max:
        raise ValueError("speculative config prompt_lookup_min must be <= prompt_lookup_max")
    return SpeculativeConfig(method, k, lookup_max, lookup_min)


def _positive(value: dict[str, Any], key: str, default: int | None) -> int:
    n = value.get(key, default)
    if n is None:
        raise ValueError(f"speculative config needs {key}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"speculative config {key} must be a positive integer, got {n!r}")
    return n
