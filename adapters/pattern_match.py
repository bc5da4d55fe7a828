"""PEFT 0.21's module matching, for a finite list of module names. Standard library only.

This file is imported by adapters.pattern_resolver for configs whose patterns
are provably cheap, and run as its own short-lived interpreter
(`python -I -S pattern_match.py`, request JSON on stdin, answer on stdout) for
anything else: a user regex can backtrack for minutes in Python's `re`, and
only a separate process can be stopped by a deadline. It must therefore not
import the adapters package or anything outside the standard library.

Semantics, copied from peft.tuners.tuners_utils.check_target_module_exists and
peft.utils.other.get_pattern_key: a target regex must fullmatch the name; list
targets match a name exactly or as a dotted suffix; exclude_modules wins
first; layers_to_transform picks the first numbered segment (through
layers_pattern when given); a rank/alpha key applies if `(.*\\.)?(key)$`
matches, the first such key in the config's order winning.
"""
from __future__ import annotations

import json
import re
import sys
from typing import Any, Sequence

# Backstops for an interpreter whose parent died before killing it; the
# parent's own deadline is much shorter.
_CPU_BACKSTOP_S = 10
_MEMORY_BACKSTOP_BYTES = 1024 * 1024 * 1024


class PatternError(ValueError):
    """A pattern in the config is not a valid regular expression; the message names the field."""


def regex_patterns(spec: dict[str, Any], names: Sequence[str]) -> list[str]:
    """The user-supplied strings that resolve() will run as regular expressions."""
    out: list[str] = []
    target = spec.get("target_modules")
    if isinstance(target, str) and target.lower() != "all-linear":
        out.append(target)
    if isinstance(spec.get("exclude_modules"), str) and spec["exclude_modules"]:
        out.append(spec["exclude_modules"])
    layers_pattern = spec.get("layers_pattern") or []
    out.extend([layers_pattern] if isinstance(layers_pattern, str) else layers_pattern)
    for field in ("rank_keys", "alpha_keys"):
        if _exact_positions(spec[field], names) is None:
            out.extend(spec[field])
    return out


def resolve(spec: dict[str, Any], names: Sequence[str]) -> dict[str, list]:
    """For each name: is it targeted, and the index of its rank/alpha key (-1: the config default).

    spec: target_modules, exclude_modules, layers_to_transform, layers_pattern
    as in adapter_config.json; rank_keys/alpha_keys, the pattern dicts' keys in
    the saved JSON's order. Raises PatternError for an invalid regex.
    """
    target = _compile_field(spec.get("target_modules"), "target_modules")
    exclude = _compile_field(spec.get("exclude_modules"), "exclude_modules")
    layers_pattern = spec.get("layers_pattern") or []
    layer_regexes = [_compile(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", "layers_pattern", p)
                     for p in ([layers_pattern] if isinstance(layers_pattern, str) else layers_pattern)]
    # Sets of the lists: PEFT scans them per module; the answers are the same, and a
    # canonical config lists every targeted module by name.
    lists = {field: set(spec[field]) if isinstance(spec.get(field), list) else set()
             for field in ("target_modules", "exclude_modules")}
    return {
        "targeted": [_is_targeted(spec, lists, target, exclude, layer_regexes, name) for name in names],
        "rank": _key_indices(spec["rank_keys"], names, "rank_pattern"),
        "alpha": _key_indices(spec["alpha_keys"], names, "alpha_pattern"),
    }


def _compile(regex: str, field: str, pattern: str | None = None) -> re.Pattern:
    """Compile `regex`, built from the user's `pattern` (the same string when None)."""
    try:
        return re.compile(regex)
    except (re.error, OverflowError, RecursionError) as e:
        shown = regex if pattern is None else pattern
        raise PatternError(f"{field} {shown[:80]!r}: invalid regular expression: {e}") from None


def _compile_field(value: Any, field: str) -> re.Pattern | None:
    if isinstance(value, str) and value and not (field == "target_modules" and value.lower() == "all-linear"):
        return _compile(value, field)
    return None


def _using_layers(layers: Any) -> bool:
    return layers is not None and (len(layers) != 0 if isinstance(layers, list) else True)


def dotted_suffixes(name: str) -> list[str]:
    """"a.b.c" -> ["a.b.c", "b.c", "c"]: t is among them iff name == t or name.endswith("." + t)."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def _is_targeted(spec: dict[str, Any], lists: dict[str, set[str]], target: re.Pattern | None,
                 exclude: re.Pattern | None, layer_regexes: list[re.Pattern], name: str) -> bool:
    if exclude is not None:
        if exclude.fullmatch(name):
            return False
    elif not lists["exclude_modules"].isdisjoint(dotted_suffixes(name)):
        return False
    if isinstance(spec["target_modules"], str):
        return target is None or target.fullmatch(name) is not None    # None: "all-linear"
    if name in lists["target_modules"]:
        return True
    found = not lists["target_modules"].isdisjoint(dotted_suffixes(name))
    layers = spec.get("layers_to_transform")
    if not (_using_layers(layers) and found):
        return found
    match = None
    if not layer_regexes:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    for regex in layer_regexes:
        match = regex.match(name)
        if match is not None:
            break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def _exact_positions(keys: Sequence[str], names: Sequence[str]) -> dict[str, int] | None:
    """{name: key index} when every key is re.escape(one of names), else None.

    Such a key matches exactly that name: the names are full dotted paths from
    the model's root, and none is a dotted suffix of another. That is how a
    canonical config is written, so loading one runs no regex at all.
    """
    escaped = {re.escape(name): name for name in names}
    if not all(key in escaped for key in keys):
        return None
    return {escaped[key]: i for i, key in enumerate(keys)}


def _key_indices(keys: Sequence[str], names: Sequence[str], field: str) -> list[int]:
    exact = _exact_positions(keys, names)
    if exact is not None:
        return [exact.get(name, -1) for name in names]
    compiled = [_compile(rf"(.*\.)?({key})$", f"{field} key", key) for key in keys]
    return [next((i for i, regex in enumerate(compiled) if regex.match(name)), -1) for name in names]


def _limit_resources() -> None:
    try:
        import resource
    except ImportError:     # not on every platform; the parent's deadline still holds
        return
    for kind, cap in ((resource.RLIMIT_CPU, _CPU_BACKSTOP_S), (resource.RLIMIT_AS, _MEMORY_BACKSTOP_BYTES)):
        _, hard = resource.getrlimit(kind)
        # Lower the soft limit only: the hard one may already be lower, and cannot be raised.
        resource.setrlimit(kind, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))


def main() -> None:
    _limit_resources()
    request = json.load(sys.stdin)
    try:
        answer: dict[str, Any] = resolve(request["spec"], request["names"])
    except PatternError as e:
        answer = {"error": str(e)}
    except (MemoryError, RecursionError):
        answer = {"error": "a regular expression needed too much memory to match the model's module names"}
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
