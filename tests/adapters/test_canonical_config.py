"""The canonical config: the same adapter with every user regex resolved away, matched once under a
deadline. Checked against loraplex itself (same LoraAdapter) and against PEFT (same modules and scalings)."""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from adapters import pattern_match, pattern_resolver
from adapters.format import (
    PROJECTIONS, ModelShape, inspect_adapter_bytes, load_adapter_bytes, load_adapter_dir, module_name)
from tests.adapters.test_adapter_format import MAX_RANK, SHAPE, peft_reloaded, read, rebuild, save_adapter


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = save_adapter(tmp_path_factory.mktemp("plain"))
    config, weights = read(path)
    return json.loads(config), safetensors.torch.load(weights)


def forbid_subprocess(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"unexpected subprocess {args}")
    monkeypatch.setattr(pattern_resolver.subprocess, "run", refuse)


def count_subprocesses(monkeypatch) -> list:
    calls = []
    real = subprocess.run

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(pattern_resolver.subprocess, "run", spy)
    return calls


def test_common_configs_spawn_no_subprocess(plain, monkeypatch):
    config, tensors = plain
    forbid_subprocess(monkeypatch)
    weights = safetensors.torch.save(tensors)
    for overrides in (dict(), dict(target_modules="all-linear"), dict(exclude_modules=["nothing_here"]),
                      dict(rank_pattern={"layers.1.mlp.down_proj": 4}, alpha_pattern={"o_proj": 3})):
        config_json = json.dumps({**config, **overrides}).encode()
        summary = inspect_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)
        load_adapter_bytes(summary.canonical_config_json, weights, SHAPE, MAX_RANK)


def test_user_regex_runs_in_a_subprocess_once_then_never(plain, monkeypatch):
    config, tensors = plain
    weights = safetensors.torch.save(tensors)
    calls = count_subprocesses(monkeypatch)
    summary = inspect_adapter_bytes(*rebuild(config, tensors, target_modules=r".*\.(q|k|v|o|gate|up|down)_proj",
                                             rank_pattern={r"layers\.[01]\.mlp\.(up|down)_proj": 4}),
                                    SHAPE, MAX_RANK)
    assert len(calls) == 1
    forbid_subprocess(monkeypatch)
    load_adapter_bytes(summary.canonical_config_json, weights, SHAPE, MAX_RANK)


def test_canonical_config_of_a_big_model_loads_fast(monkeypatch):
    """80 layers, a rank and alpha override on every module: exact keys are looked up, not matched."""
    names = [module_name(layer, proj) for layer in range(80) for proj in PROJECTIONS]
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": names,
           "rank_pattern": {re.escape(n): 4 for n in names}, "alpha_pattern": {re.escape(n): 4 for n in names}}
    forbid_subprocess(monkeypatch)
    start = time.monotonic()
    resolved = pattern_resolver.resolve_modules(cfg, names, "adapter_config.json")
    assert time.monotonic() - start < 0.5
    assert set(resolved.ranks.values()) == {4} and list(resolved.ranks) == names


# ---- canonical config: same adapter, in loraplex and in PEFT ------------------------

def assert_same_adapter(x, y) -> None:
    assert set(x.weights) == set(y.weights)
    for slot, w in x.weights.items():
        assert torch.equal(w.a, y.weights[slot].a) and torch.equal(w.b, y.weights[slot].b), slot
        assert w.scaling == y.weights[slot].scaling and w.rank == y.weights[slot].rank, slot
    assert (x.rank, x.target_modules, x.use_rslora, x.size_bytes) == (y.rank, y.target_modules, y.use_rslora,
                                                                       y.size_bytes)


CANONICAL_VARIANTS = {
    "list_targets": dict(),
    "qv_only": dict(target_modules=["q_proj", "v_proj"]),
    "all_linear": dict(target_modules="all-linear"),
    "regex_targets": dict(target_modules=r".*\.(k_proj|gate_proj)"),
    "regex_targets_layer": dict(target_modules=r"model\.layers\.1\..*(q|up)_proj"),
    "rank_pattern": dict(rank_pattern={"v_proj": 2, "layers.1.self_attn.q_proj": 8, "down_proj": 6}),
    "rank_pattern_regex": dict(rank_pattern={r"layers\.[01]\.self_attn\.(q|k)_proj": 2, r"mlp\..*": 6}),
    "alpha_pattern_regex": dict(alpha_pattern={r".*\.(o|up)_proj": 3, r"layers\.0\..*": 32}),
    "rslora_patterns": dict(use_rslora=True, rank_pattern={"o_proj": 16}, alpha_pattern={r"(o|v)_proj": 5}),
    "exclude_list": dict(exclude_modules=["down_proj", "layers.0.self_attn.k_proj"]),
    "exclude_regex": dict(exclude_modules=r".*\.1\.mlp\..*"),
    "layers_to_transform": dict(layers_to_transform=[1]),
    "layers_pattern": dict(layers_to_transform=[0], layers_pattern="layers"),
    "overlapping_alpha": dict(alpha_pattern={"q_proj": 3, "layers.1.self_attn.q_proj": 5}),
}


@pytest.mark.parametrize("variant", sorted(CANONICAL_VARIANTS))
def test_canonical_config_is_the_same_adapter(tmp_path, variant, monkeypatch):
    original_dir = save_adapter(tmp_path / "original", **CANONICAL_VARIANTS[variant])
    config_json, weights = read(original_dir)
    original = load_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)
    canonical_json = inspect_adapter_bytes(config_json, weights, SHAPE, MAX_RANK).canonical_config_json

    canonical = json.loads(canonical_json)
    names = [module_name(layer, proj) for layer in range(SHAPE.num_layers) for proj in PROJECTIONS]
    assert canonical["target_modules"] == [n for n in names if (int(n.split(".")[2]), n.split(".")[-1])
                                           in original.weights]
    assert canonical["exclude_modules"] is None and canonical["layers_to_transform"] is None
    assert canonical["layers_pattern"] is None
    escaped = {re.escape(n) for n in names}
    assert set(canonical["rank_pattern"]) <= escaped and set(canonical["alpha_pattern"]) <= escaped

    forbid_subprocess(monkeypatch)      # the canonical form runs no user regex, in-process or not
    assert_same_adapter(original, load_adapter_bytes(canonical_json, weights, SHAPE, MAX_RANK))
    # canonicalising is idempotent, byte for byte
    assert inspect_adapter_bytes(canonical_json, weights, SHAPE, MAX_RANK).canonical_config_json == canonical_json
    monkeypatch.undo()

    # PEFT itself targets and scales the canonical config exactly as the original
    canonical_dir = tmp_path / "canonical"
    shutil.copytree(original_dir, canonical_dir)
    (canonical_dir / "adapter_config.json").write_bytes(canonical_json)
    expected, got = peft_reloaded(original_dir), peft_reloaded(canonical_dir)
    assert set(got) == set(expected) == set(original.weights)
    for slot, (a, b, scaling) in expected.items():
        assert torch.equal(got[slot][0], a) and torch.equal(got[slot][1], b), slot
        assert got[slot][2] == scaling == original.weights[slot].scaling, slot


MATCHING_CASES = [
    dict(target_modules=["q_proj", "mlp.up_proj", "layers.2.self_attn.o_proj"]),
    dict(target_modules=r".*\.(q|k)_proj", exclude_modules=r".*\.1\..*"),
    dict(target_modules=["q_proj", "v_proj", "down_proj"], exclude_modules=["v_proj", "layers.0.mlp.down_proj"]),
    dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[0, 2]),
    dict(target_modules=["q_proj", "down_proj"], layers_to_transform=1, layers_pattern=["nope", "layers"]),
    dict(target_modules=["v_proj"], rank_pattern={r"layers\.[12]\..*": 2, "v_proj": 3, r"q_pr.j": 5},
         alpha_pattern={"2.self_attn.v_proj": 7, r"(?:k|v)_proj": 1}),
    dict(target_modules=r"model\.layers\.\d\.mlp\.(gate|up)_proj", rank_pattern={r"gate_proj|up_proj": 2}),
]


@pytest.mark.parametrize("kwargs", MATCHING_CASES, ids=range(len(MATCHING_CASES)))
def test_matching_agrees_with_peft_functions(kwargs):
    """pattern_match against PEFT's own check_target_module_exists and get_pattern_key, name by name."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    config = LoraConfig(**kwargs)
    spec = {f: kwargs.get(f) for f in ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")}
    spec.update(rank_keys=list(kwargs.get("rank_pattern", {})), alpha_keys=list(kwargs.get("alpha_pattern", {})))
    names = [module_name(layer, proj) for layer in range(3) for proj in PROJECTIONS] + ["model.embed_tokens"]
    answer = pattern_match.resolve(spec, names)
    for name, targeted, rank_i, alpha_i in zip(names, answer["targeted"], answer["rank"], answer["alpha"]):
        assert targeted == bool(check_target_module_exists(config, name)), name
        for keys, i in ((spec["rank_keys"], rank_i), (spec["alpha_keys"], alpha_i)):
            assert get_pattern_key(keys, name) == (keys[i] if i >= 0 else name), name


def test_canonical_rank_alpha_overrides_list_only_differences(plain):
    config, tensors = plain
    summary = inspect_adapter_bytes(*rebuild(config, tensors, alpha_pattern={r".*": 8, "q_proj": 2}),
                                    SHAPE, MAX_RANK)
    canonical = json.loads(summary.canonical_config_json)
    # ".*" comes first and matches everything with the default alpha 8: nothing differs
    assert canonical["alpha_pattern"] == {} and canonical["rank_pattern"] == {}


def test_matcher_runs_alone_on_the_standard_library(tmp_path):
    """pattern_match runs as `python -I -S file`: it may import nothing outside the standard library."""
    tree = ast.parse(Path(pattern_match.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported
    spec = {"target_modules": r".*\.(q|v)_proj", "exclude_modules": r".*\.1\.self_attn\.v_proj",
            "layers_to_transform": None, "layers_pattern": None, "rank_keys": [r"v_pr.j", "q_proj"],
            "alpha_keys": []}
    names = [module_name(layer, proj) for layer in range(2) for proj in PROJECTIONS]
    done = subprocess.run([sys.executable, "-I", "-S", pattern_match.__file__], cwd=tmp_path, check=True,
                          input=json.dumps({"spec": spec, "names": names}).encode(), capture_output=True)
    answer = json.loads(done.stdout)
    assert answer == pattern_match.resolve(spec, names)
    assert [n for n, t in zip(names, answer["targeted"]) if t] == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.q_proj"]
    assert answer["rank"][:3] == [1, -1, 0]


def test_real_adapters_pass(demo_paths, tiny_model_dir, tiny_adapters):
    """The demo adapters and the test fixtures load, and their canonical configs load identically."""
    cases = [(demo_paths.model_dir, d) for d in demo_paths.adapters.values()]
    cases += [(tiny_model_dir, d) for d in tiny_adapters.values()]
    for model_dir, adapter_dir in cases:
        shape = ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
        original = load_adapter_dir(adapter_dir, shape, 64)
        summary = inspect_adapter_bytes(*read(Path(adapter_dir)), shape, 64)
        canonical = load_adapter_bytes(summary.canonical_config_json, read(Path(adapter_dir))[1], shape, 64)
        assert_same_adapter(original, canonical)
