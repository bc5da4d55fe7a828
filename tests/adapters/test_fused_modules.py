"""Adapters of a fused model (Phi-3: qkv_proj and gate_up_proj, as PEFT targets them): each fused module's
lora_B rows split into the projections it fuses, sharing its lora_A; fused names on an unfused model, and
fused names beside split ones, are refused."""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from adapters.format import AdapterFormatError, ModelShape, load_adapter_dir


@pytest.fixture(scope="module")
def phi3(arch_model):
    model_dir, adapters = arch_model("phi3")
    return ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text())), adapters


def test_fused_modules_split_into_their_projections(phi3):
    shape, adapters = phi3
    assert shape.fused_projections and shape.projections == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    adapter = load_adapter_dir(adapters["dora_r16"], shape, 64)
    saved = safetensors.torch.load_file(adapters["dora_r16"] / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1."
    for fused, parts, parent in (("qkv_proj", ("q_proj", "k_proj", "v_proj"), "self_attn"),
                                 ("gate_up_proj", ("gate_proj", "up_proj"), "mlp")):
        key = f"{prefix}{parent}.{fused}"
        split = [adapter.weights[(1, p)] for p in parts]
        assert all(torch.equal(w.a, saved[f"{key}.lora_A.weight"]) for w in split)
        assert torch.equal(torch.cat([w.b for w in split]), saved[f"{key}.lora_B.weight"])
        assert torch.equal(torch.cat([w.magnitude for w in split]), saved[f"{key}.lora_magnitude_vector"])
    assert adapter.target_modules == ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")


def test_fused_names_need_a_fused_model(phi3):
    shape, adapters = phi3
    unfused = ModelShape(shape.num_layers, shape.hidden_size, shape.q_size, shape.kv_size, shape.intermediate_size)
    with pytest.raises(AdapterFormatError, match="'qkv_proj' is not among"):
        load_adapter_dir(adapters["r8_all"], unfused, 64)


def test_split_and_fused_names_are_not_mixed(phi3, tmp_path):
    """An adapter listing split names is matched against them alone: a fused module beside them is refused."""
    shape, adapters = phi3
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "adapter_model.safetensors").write_bytes((adapters["r8_all"] / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((adapters["r8_all"] / "adapter_config.json").read_text())
    (mixed / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "qkv_proj"]}))
    with pytest.raises(AdapterFormatError, match="'qkv_proj' is not among"):
        load_adapter_dir(mixed, shape, 64)
