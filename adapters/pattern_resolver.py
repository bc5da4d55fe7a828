"""Resolve a config's module patterns against the model once, under a deadline, into a canonical config.

A config's target_modules (as a regex), exclude_modules (as a regex),
layers_pattern and rank/alpha_pattern keys are regular expressions that
Python's backtracking `re` runs against module names; `(.|.){0,24}\\.q_proj`
takes tens of seconds per name and holds the GIL throughout. The model's
module names are a finite list, so the patterns are matched against that list
in a separate interpreter (adapters/pattern_match.py) that is killed at
RESOLVE_TIMEOUT_S; a thread could neither be stopped nor let other tenants run.

The outcome is also written back as a *canonical config*: the same adapter
with no user regex (the explicit list of targeted module names, rank/alpha
overrides keyed by exact escaped names, no exclude/layers fields). Loading it
gives the same modules, ranks and scalings, in loraplex and in PEFT, and it
resolves in-process without any regex, so a stored canonical config never
runs the user's pattern again.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from adapters import pattern_match
from adapters.peft_config import PROJECTIONS, AdapterFormatError
from adapters.vocab_format import VOCAB_MODULES

# Wall-clock bound for matching every pattern against every module name,
# interpreter start-up (~20 ms) included; sane patterns need milliseconds.
RESOLVE_TIMEOUT_S = 2.0
# Patterns made of word characters and dots only (each '.' optionally
# escaped) have no quantifier, group, class or alternation, so re matches them
# in time polynomial in a ~40-character name: safe to run in-process, a few
# dozen at a time. Everything else goes to the subprocess.
_PLAIN = re.compile(r"(?:[A-Za-z0-9_]|\\?\.)+")
MAX_INLINE_PATTERNS = 32
# Modules outside the decoder layers that PEFT can target: LoRA on them is served by
# adapters.vocab_format and the engine's server.engine.lora.vocab_parts.
_OUTSIDE = VOCAB_MODULES
_MATCHER = Path(pattern_match.__file__)


@dataclass(frozen=True)
class ResolvedModules:
    # targeted module name -> r (rank_pattern applied), in the model's order; embed_tokens and lm_head last
    ranks: Mapping[str, int]
    alphas: Mapping[str, float]    # targeted module name -> lora_alpha (alpha_pattern applied)
    canonical_json: bytes          # the canonical adapter_config.json


def resolve_modules(cfg: Mapping[str, Any], names: Sequence[str], source: str, *, parameters: Sequence[str] = (),
                    timeout_s: float = RESOLVE_TIMEOUT_S) -> ResolvedModules:
    """Which of `names` (the model's projection modules, in order) and of embed_tokens and lm_head cfg
    targets, with rank and alpha each; `parameters`: the parameters its target_parameters names (an MoE
    model's fused experts), which get rank and alpha by the same patterns (PEFT matches rank_pattern
    against the parameter's name), and are in `ranks` and `alphas` after the modules."""
    target = cfg.get("target_modules") or []
    if isinstance(target, list):
        suffixes = {s for n in [*names, *_OUTSIDE] for s in pattern_match.dotted_suffixes(n)}
        for t in target:
            if t not in suffixes:      # PEFT: t is a name, or a dotted suffix of one
                raise AdapterFormatError(f"{source}: target module {t!r} is not among the model's adaptable "
                                         f"modules ({', '.join(PROJECTIONS)} of {len(names) // len(PROJECTIONS)} "
                                         "layers, embed_tokens, lm_head)")
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    spec = {field: cfg.get(field) for field in
            ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")}
    spec.update(rank_keys=list(rank_pattern), alpha_keys=list(alpha_pattern))
    probed = [*names, *_OUTSIDE, *parameters]
    regexes = pattern_match.regex_patterns(spec, probed)
    if len(regexes) <= MAX_INLINE_PATTERNS and all(_PLAIN.fullmatch(p) for p in regexes):
        try:
            answer = pattern_match.resolve(spec, probed)
        except pattern_match.PatternError as e:
            raise AdapterFormatError(f"{source}: {e}") from None
    else:
        answer = _resolve_isolated(spec, probed, source, timeout_s)

    # "all-linear" is PEFT's shorthand for the Linear layers except the output layer: neither module in
    # _OUTSIDE (the embedding is no Linear).
    all_linear = isinstance(target, str) and target.lower() == "all-linear"
    targeted = [t and not (all_linear and name in _OUTSIDE) for name, t in zip(probed, answer["targeted"])]
    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rank_keys, alpha_keys = list(rank_pattern), list(alpha_pattern)
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for name, hit, rank_i, alpha_i in zip(probed, targeted, answer["rank"], answer["alpha"]):
        if hit or name in parameters:
            ranks[name] = rank_pattern[rank_keys[rank_i]] if rank_i >= 0 else r
            alphas[name] = alpha_pattern[alpha_keys[alpha_i]] if alpha_i >= 0 else alpha
    if not ranks:
        raise AdapterFormatError(f"{source}: the config targets no module of the model")
    modules = [n for n in ranks if n not in parameters]
    canonical = {**cfg, "target_modules": modules, "exclude_modules": None, "layers_to_transform": None,
                 "layers_pattern": None,
                 "rank_pattern": {re.escape(n): v for n, v in ranks.items() if v != r},
                 "alpha_pattern": {re.escape(n): v for n, v in alphas.items() if v != alpha}}
    if parameters:
        canonical["target_parameters"] = list(parameters)
    # ASCII: the bytes are stored and re-parsed; strings were checked encodable at parse.
    canonical_json = json.dumps(canonical, indent=2, ensure_ascii=True).encode("ascii")
    return ResolvedModules(MappingProxyType(ranks), MappingProxyType(alphas), canonical_json)


def _resolve_isolated(spec: dict[str, Any], names: list[str], source: str, timeout_s: float) -> dict[str, list]:
    """pattern_match.resolve in a fresh `python -I -S`, killed at the deadline."""
    request = json.dumps({"spec": spec, "names": names}).encode("ascii")
    try:
        done = subprocess.run([sys.executable, "-I", "-S", str(_MATCHER)], input=request, capture_output=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise AdapterFormatError(
            f"{source}: a regular expression in {_regex_fields(spec)} took too long to match the model's "
            f"{len(names)} module names (limit {timeout_s:g} s); list the module names instead, or use a "
            "simpler pattern") from None
    if done.returncode < 0:
        # Killed by the interpreter's own CPU/memory backstops (pattern_match).
        raise AdapterFormatError(f"{source}: matching the regular expressions in {_regex_fields(spec)} "
                                 f"exceeded the CPU or memory limit (signal {-done.returncode})")
    if done.returncode != 0:
        # Not the adapter's fault (a broken interpreter or install): a server error, not a refusal.
        tail = done.stderr.decode("utf-8", "replace")[-500:]
        raise RuntimeError(f"pattern matcher {_MATCHER} exited with {done.returncode}: {tail}")
    answer = json.loads(done.stdout)
    if "error" in answer:
        raise AdapterFormatError(f"{source}: {answer['error']}")
    if not all(len(answer[k]) == len(names) for k in ("targeted", "rank", "alpha")):
        raise RuntimeError(f"pattern matcher {_MATCHER} answered for the wrong number of names")
    return answer


def _regex_fields(spec: Mapping[str, Any]) -> str:
    """The config fields that hold patterns, for messages."""
    fields = [f for f in ("target_modules", "exclude_modules") if isinstance(spec.get(f), str)]
    fields += ["layers_pattern"] if spec.get("layers_pattern") else []
    fields += [f for f, k in (("rank_pattern", "rank_keys"), ("alpha_pattern", "alpha_keys")) if spec[k]]
    return ", ".join(fields) or "the config"
