"""Qwen3-MoE with dense MLP layers between its sparse ones (`decoder_sparse_step` 2, `mlp_only_layers`).

On transformers 5 PEFT turns any gate/up/down_proj target of a Qwen3-MoE model into target_parameters on
the experts, so a LoRA on the dense layers' MLP is one written with transformers 4 (tests.moe_linear_adapters),
checked against the model with its LoRA merged by hand; target_parameters and DoRA-on-attention adapters
against peft. One mixed batch: greedy tokens and logprobs (float32, 1e-4)."""
from __future__ import annotations

import json

import pytest

from adapters.format import ModelShape, load_adapter_dir
from benchmarks.engine.moe_models import VOCAB, make_moe_adapter, make_moe_model
from server.engine import ModelConfig, SamplingParams
from server.engine.config import EngineConfig
from server.engine.engine_startup import _adapter_shape
from tests.engine_helpers import generate_in_one_batch, random_prompts
from tests.moe_linear_adapters import make_linear_adapter, merged_model
from tests.server.engine.test_engine_architectures import reference
from tests.server.engine.test_engine_logprobs import assert_matches
from tests.server.engine.test_engine_moe import make_llm

ARCH = "Qwen3MoeForCausalLM"
# 6 layers, a sparse one every 2nd (1, 3, 5), 3 made dense by mlp_only_layers: experts in layers 1 and 5.
DENSE = dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
BOTH = ["experts.gate_up_proj", "experts.down_proj"]
PEFT_ADAPTERS = {  # name -> (r, lora_alpha, target_modules, target_parameters, use_rslora, use_dora)
    "r4_experts": (4, 8, ["q_proj", "v_proj"], BOTH, False, False),
    "dora_r8": (8, 16, ["q_proj", "o_proj"], [], False, True),
}
# name -> (r, lora_alpha, target_modules, rank_pattern, alpha_pattern): the dense MLPs and every expert's
# Linears; the dense MLPs only, at another rank in one layer.
LINEAR_ADAPTERS = {
    "linear_mlp": (8, 16, ["q_proj", "gate_proj", "up_proj", "down_proj"], {}, {"layers.2.mlp.up_proj": 4}),
    "dense_only": (4, 8, ["layers.0.mlp.gate_proj", "layers.3.mlp.down_proj", "layers.4.mlp.up_proj"],
                   {"layers.3.mlp.down_proj": 2}, {}),
}


@pytest.fixture(scope="module")
def dense_moe(tmp_path_factory):
    """(model dir, {adapter: dir}, {adapter: (oracle model dir, oracle adapter dir or None)})."""
    root = tmp_path_factory.mktemp("qwen3_moe_dense")
    model_dir = make_moe_model(root / "base", "qwen3_moe", **DENSE)
    adapters, oracles = {}, {}
    for i, (name, spec) in enumerate(PEFT_ADAPTERS.items()):
        adapters[name] = make_moe_adapter(model_dir, root / name, *spec, seed=90 + i)
        oracles[name] = model_dir, adapters[name]
    for i, (name, spec) in enumerate(LINEAR_ADAPTERS.items()):
        adapters[name] = make_linear_adapter(model_dir, adapters["r4_experts"], root / name, ARCH, *spec, seed=95 + i)
        oracles[name] = merged_model(model_dir, adapters[name], ARCH, root / f"{name}_merged"), None
    return model_dir, adapters, oracles


def test_layers_are_dense_or_sparse_as_transformers_builds_them(dense_moe):
    model_dir, adapters, _ = dense_moe
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.dense_layers == (0, 2, 3, 4) and [cfg.is_sparse(i) for i in (1, 5)] == [True, True]
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    assert shape == _adapter_shape(cfg, EngineConfig.of(model=str(model_dir)))
    adapter = load_adapter_dir(adapters["linear_mlp"], shape, 64)
    assert {layer for layer, proj in adapter.weights if proj == "gate_proj"} == {0, 2, 3, 4}
    assert {layer for layer, proj in adapter.weights if proj.startswith("experts.")} == {1, 5}
    assert adapter.weights[(2, "up_proj")].scaling == 0.5 and adapter.weights[(0, "down_proj")].a.shape == (8, 128)
    experts = load_adapter_dir(adapters["r4_experts"], shape, 64)
    assert {layer for layer, proj in experts.weights if proj.startswith("experts.")} == {1, 5}


def test_mixed_batch_matches_peft_and_merged_weights(dense_moe, peft_oracle):
    model_dir, adapters, oracles = dense_moe
    llm = make_llm(model_dir, adapters, max_num_batched_tokens=512)
    names = ["linear_mlp", None, "r4_experts", "dense_only", "dora_r8", "linear_mlp", "r4_experts"]
    prompts = random_prompts(len(names), (5, 30), VOCAB, seed=91)
    params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, temperature=0.0, ignore_eos=True)
    outs = generate_in_one_batch(llm, prompts, names, params)
    for prompt, name, out in zip(prompts, names, outs):
        oracle = oracles[name] if name else (model_dir, None)
        expected = peft_oracle(*oracle, prompt, 6)
        assert out.token_ids == expected, f"adapter {name}: engine {out.token_ids} != oracle {expected}"
        ref = reference(*oracle, prompt + out.token_ids)
        assert_matches(out, prompt, params, ref)
        if name:
            assert (ref - reference(model_dir, None, prompt + out.token_ids)).abs().max() > 1e-2, name
