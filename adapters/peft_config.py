"""adapter_config.json: parse and validate, before any pattern is matched.

The config is untrusted: it is parsed with bounded depth, integer length and
finite numbers (adapters.bounded_json), and its fields are checked for the
types and values PEFT (0.21) accepts. Its patterns are only type- and
length-checked here; they are compiled and matched against the model's module
names in adapters.pattern_resolver, under a deadline. Anything loraplex could
not reproduce exactly is refused with an AdapterFormatError that says why.
"""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Mapping

from adapters.activation import FIELD as INVOCATION_FIELD, invocation_config_problem
from adapters.bounded_json import JsonLimitError, loads_bounded

# A user regex is matched in a subprocess under a deadline, but its length is
# bounded too: real patterns are a few dozen characters, and a bound keeps the
# request to the matcher and every error message small.
MAX_PATTERN_CHARS = 1024

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# What a fused model (Phi-3/Phi-4) has instead of q/k/v and gate/up, as PEFT targets them: one module
# each, whose lora_B spans the projections it fuses, in this order.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class AdapterFormatError(ValueError):
    """The adapter cannot be served exactly; the message names the file/key/module and why, and
    `param` the config field at fault where one is (the HTTP error's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _positive_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


# ---- adapter_config.json --------------------------------------------------

# Base-mutating initialisations: PEFT rewrites the base weights when it loads
# these, so serving them on the unmodified base would not match PEFT.
_BASE_MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
# Fields that turn on a variant whose forward pass or saved state is not plain LoRA.
_UNSUPPORTED_TRUTHY = MappingProxyType({
    "lora_bias": "lora_bias=true (a bias on lora_B) is not supported",
    "fan_in_fan_out": "fan_in_fan_out=true (Conv1D-style weights) is not supported",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not supported",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
    "velora_config": "the VeLoRA variant (velora_config) is not supported",
    "monteclora_config": "the MonteCLoRA variant (monteclora_config) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "the KaSA variant (kasa_config) is not supported",
})


def _parse_config(raw: bytes, source: str) -> Mapping[str, Any]:
    """Parse and validate adapter_config.json; returns the dict, checked."""
    try:
        cfg = loads_bounded(raw)
    except JsonLimitError as e:
        raise AdapterFormatError(f"{source}: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterFormatError(f"{source}: must be a JSON object")

    def bad(why: str) -> AdapterFormatError:
        return AdapterFormatError(f"{source}: {why}")

    if cfg.get("peft_type") != "LORA":
        raise bad(f"peft_type is {cfg.get('peft_type')!r}, only 'LORA' adapters are served")
    for key, why in _UNSUPPORTED_TRUTHY.items():
        if cfg.get(key):
            raise bad(why)
    # Activated LoRA is served (adapters.activation); its field is checked, never ignored.
    if (why := invocation_config_problem(cfg)) is not None:
        raise AdapterFormatError(f"{source}: {why}", param=INVOCATION_FIELD)
    if cfg.get("bias", "none") != "none":
        raise bad(f"bias={cfg['bias']!r} is not supported (trained base biases); need 'none'")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MUTATING_INITS):
        raise bad(f"init_lora_weights={init!r} modifies the base model; convert it with "
                  "save_pretrained(path_initial_model_for_weight_conversion=...) first")
    if init not in _PLAIN_INITS:
        raise bad(f"unknown init_lora_weights={init!r}")
    if not _positive_int(cfg.get("r", 8)):
        raise bad(f"r must be a positive integer, got {cfg.get('r')!r}")
    if not _finite_number(cfg.get("lora_alpha", 8)):
        raise bad(f"lora_alpha must be a finite number, got {cfg.get('lora_alpha')!r}")
    for flag in ("use_rslora", "use_dora"):
        if not isinstance(cfg.get(flag, False), bool):
            raise bad(f"{flag} must be true or false")
    for field, valid in (("rank_pattern", _positive_int), ("alpha_pattern", _finite_number)):
        pattern = cfg.get(field) or {}
        if not isinstance(pattern, dict) or not all(valid(v) for v in pattern.values()):
            kind = "positive ints" if field == "rank_pattern" else "finite numbers"
            raise bad(f"{field} must map module patterns to {kind}")
        for key in pattern:
            _check_pattern_length(key, f"{source}: {field} key")
    _check_targets(cfg, source)
    return MappingProxyType(cfg)


def _finite_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_pattern_length(pattern: str, where: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterFormatError(f"{where} {pattern[:40]!r}... is {len(pattern)} characters long; patterns are "
                                 f"limited to {MAX_PATTERN_CHARS}")


def _check_targets(cfg: Mapping[str, Any], source: str) -> None:
    """Types and lengths of the targeting fields; pattern_resolver matches them against the model."""
    layers = cfg.get("layers_to_transform")
    if not (layers is None or _is_index(layers) or isinstance(layers, list) and all(map(_is_index, layers))):
        raise AdapterFormatError(f"{source}: layers_to_transform must be a layer index or a list of them")
    for field in ("layers_pattern", "exclude_modules"):
        value = cfg.get(field)
        if not (value is None or isinstance(value, str)
                or isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise AdapterFormatError(f"{source}: {field} must be a string or a list of strings")
    if isinstance(cfg.get("exclude_modules"), str):
        _check_pattern_length(cfg["exclude_modules"], f"{source}: exclude_modules")
    pattern = cfg.get("layers_pattern")
    for p in [pattern] if isinstance(pattern, str) else pattern or []:
        _check_pattern_length(p, f"{source}: layers_pattern")
    # PEFT's LoraConfig refuses this combination (and the regex ones below) too.
    if pattern and layers is None:
        raise AdapterFormatError(f"{source}: layers_pattern needs layers_to_transform")

    params = cfg.get("target_parameters")
    if params is not None and (not isinstance(params, list) or not all(isinstance(t, str) for t in params)):
        raise AdapterFormatError(f"{source}: target_parameters must be a list of parameter names", "target_parameters")
    if params and cfg.get("use_dora"):  # PEFT's ParamWrapper refuses it too
        raise AdapterFormatError(f"{source}: use_dora with target_parameters (DoRA on MoE experts) is not supported",
                                 "use_dora")
    target = cfg.get("target_modules")
    if params and target in (None, []):  # only parameters targeted: PEFT takes target_modules=[] then
        return
    if isinstance(target, str):
        if layers is not None or pattern is not None:
            raise AdapterFormatError(f"{source}: layers_to_transform/layers_pattern cannot be used with a "
                                     "regex target_modules")
        _check_pattern_length(target, f"{source}: target_modules")
    elif not isinstance(target, list) or not target or not all(isinstance(t, str) for t in target):
        raise AdapterFormatError(f"{source}: target_modules must be a non-empty list of names or a regex string")


def _is_index(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
