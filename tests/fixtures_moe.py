"""The MoE tests' models and adapters (benchmarks.engine.moe_models), built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.engine.moe_models import MOE_MODELS, make_moe_adapter, make_moe_model

BOTH = ["experts.gate_up_proj", "experts.down_proj"]
# adapter name -> (r, lora_alpha, target_modules, target_parameters, use_rslora, use_dora): ranks 8, 4 and 2,
# every expert weight alone and together, attention modules or none; DoRA on attention (not on experts:
# PEFT refuses that).
MOE_ADAPTERS = {
    "r8_all": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], BOTH, False, False),
    "r4_qv": (4, 8, ["q_proj", "v_proj"], ["mlp.experts.down_proj"], True, False),
    "r2_experts": (2, 4, [], ["gate_up_proj"], False, False),
    "dora_r16": (16, 16, ["q_proj", "v_proj", "o_proj"], [], False, True),
}


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory):
    """moe_model(name in MOE_MODELS) -> (model_dir, {adapter name in MOE_ADAPTERS: dir})."""
    cache: dict[str, tuple[Path, dict[str, Path]]] = {}

    def get(name: str) -> tuple[Path, dict[str, Path]]:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            model_dir = make_moe_model(root / "base", name)
            cache[name] = model_dir, {
                adapter: make_moe_adapter(model_dir, root / adapter, *spec, seed=40 + i)
                for i, (adapter, spec) in enumerate(MOE_ADAPTERS.items())}
        return cache[name]

    return get
