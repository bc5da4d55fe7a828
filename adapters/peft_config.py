"""adapter_config.json: parse, validate, and PEFT's module targeting rules.

Semantics follow the installed PEFT (0.21) exactly: which modules a config
targets (`check_target_module_exists`) and per-module rank/alpha overrides
(`get_pattern_key`: the first key, in the saved JSON's order, whose regex
`(.*\\.)?(key)$` matches the module name). Anything loraplex could not
reproduce exactly is refused with an AdapterFormatError that says why.
"""
from __future__ import annotations

import json
import math
import re
from types import MappingProxyType
from typing import Any, Mapping

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterFormatError(ValueError):
    """The adapter cannot be served exactly; the message names the file/key/module and why."""


def _positive_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


# ---- adapter_config.json --------------------------------------------------

# Base-mutating initialisations: PEFT rewrites the base weights when it loads
# these, so serving them on the unmodified base would not match PEFT.
_BASE_MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
# Fields that turn on a variant whose forward pass or saved state is not plain LoRA.
_UNSUPPORTED_TRUTHY = MappingProxyType({
    "use_dora": "DoRA (use_dora) is not supported",
    "lora_bias": "lora_bias=true (a bias on lora_B) is not supported",
    "fan_in_fan_out": "fan_in_fan_out=true (Conv1D-style weights) is not supported",
    "modules_to_save": "modules_to_save must be empty: fully trained modules are not served",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "layer_replication": "layer_replication is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
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
        cfg = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterFormatError(f"{source}: invalid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterFormatError(f"{source}: must be a JSON object")

    def bad(why: str) -> AdapterFormatError:
        return AdapterFormatError(f"{source}: {why}")

    if cfg.get("peft_type") != "LORA":
        raise bad(f"peft_type is {cfg.get('peft_type')!r}, only 'LORA' adapters are served")
    for key, why in _UNSUPPORTED_TRUTHY.items():
        if cfg.get(key):
            raise bad(why)
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
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise bad("use_rslora must be true or false")
    for field, valid in (("rank_pattern", _positive_int), ("alpha_pattern", _finite_number)):
        pattern = cfg.get(field) or {}
        if not isinstance(pattern, dict) or not all(valid(v) for v in pattern.values()):
            kind = "positive ints" if field == "rank_pattern" else "finite numbers"
            raise bad(f"{field} must map module patterns to {kind}")
        for key in pattern:
            _compile(key, f"{source}: {field} key {key!r}")
    _check_targets(cfg, source)
    return MappingProxyType(cfg)


def _finite_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _compile(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise AdapterFormatError(f"{where}: invalid regular expression: {e}") from None


def _check_targets(cfg: Mapping[str, Any], source: str) -> None:
    """Types and regexes of the targeting fields; names are checked against the model in _plan."""
    layers = cfg.get("layers_to_transform")
    if not (layers is None or _is_index(layers) or isinstance(layers, list) and all(map(_is_index, layers))):
        raise AdapterFormatError(f"{source}: layers_to_transform must be a layer index or a list of them")
    for field in ("layers_pattern", "exclude_modules"):
        value = cfg.get(field)
        if not (value is None or isinstance(value, str)
                or isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise AdapterFormatError(f"{source}: {field} must be a string or a list of strings")
    if isinstance(cfg.get("exclude_modules"), str):
        _compile(cfg["exclude_modules"], f"{source}: exclude_modules")
    pattern = cfg.get("layers_pattern")
    for p in [pattern] if isinstance(pattern, str) else pattern or []:
        _compile(p, f"{source}: layers_pattern")

    target = cfg.get("target_modules")
    if isinstance(target, str):
        # PEFT's LoraConfig refuses these combinations too.
        if layers is not None or pattern is not None:
            raise AdapterFormatError(f"{source}: layers_to_transform/layers_pattern cannot be used with a "
                                     "regex target_modules")
        if target.lower() == "all-linear":
            return
        regex = _compile(target, f"{source}: target_modules")
        for other in ("model.embed_tokens", "lm_head"):
            if regex.fullmatch(other):
                raise AdapterFormatError(f"{source}: target_modules regex {target!r} matches {other}; "
                                         f"only {', '.join(PROJECTIONS)} can be adapted")
    elif not isinstance(target, list) or not target or not all(isinstance(t, str) for t in target):
        raise AdapterFormatError(f"{source}: target_modules must be a non-empty list of names or a regex string")


def _is_index(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_targeted(cfg: Mapping[str, Any], name: str) -> bool:
    """peft.tuners.tuners_utils.check_target_module_exists, for one projection's module name."""
    exclude = cfg.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, name):
                return False
        elif name in exclude or any(name.endswith(f".{e}") for e in exclude):
            return False
    target = cfg["target_modules"]
    if isinstance(target, str):
        return target.lower() == "all-linear" or re.fullmatch(target, name) is not None
    if name in target:
        return True
    found = any(name.endswith(f".{t}") for t in target)
    layers = cfg.get("layers_to_transform")
    using_layers = layers is not None and (len(layers) != 0 if isinstance(layers, list) else True)
    if not (using_layers and found):
        return found
    pattern = cfg.get("layers_pattern")
    if pattern is None or len(pattern) == 0:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        for p in [pattern] if isinstance(pattern, str) else pattern:
            match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def _pattern_value(patterns: Mapping[str, Any], name: str, default: Any) -> Any:
    """peft.utils.other.get_pattern_key + dict lookup: first matching key wins."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return patterns[key]
    return default
