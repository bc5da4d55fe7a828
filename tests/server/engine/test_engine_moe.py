"""Mixtral and Qwen3-MoE with LoRA on attention and experts (tests.fixtures_moe): mixed batches of base rows,
adapters of ranks 8, 4 and 2 (on both fused expert weights, on one each) and a DoRA one on attention give
transformers + peft's greedy tokens and logprobs (float32, 1e-4), in one forward pass, through chunked
prefill, and through preemption and prefix-cache hits; what is not served is refused by name."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from adapters.format import AdapterFormatError, ModelShape, load_adapter_dir
from kernels.expert_batch import ExpertBatch
from benchmarks.engine.moe_models import MOE_MODELS, VOCAB, make_moe_adapter
from server.engine import LLM, ModelConfig, SamplingParams
from server.engine.config import EngineConfig, ModelConfigError
from server.engine.engine_startup import _adapter_shape
from tests.engine_helpers import (
    assert_matches_peft, generate_in_one_batch, generate_through_preemption_and_prefix_hits, random_prompts)
from tests.server.engine.test_engine_architectures import reference
from tests.server.engine.test_engine_logprobs import assert_matches

NAMES = ["r8_all", None, "r4_qv", "r2_experts", "r8_all", "dora_r16", None, "r2_experts"]


def make_llm(model_dir, adapters, **kw) -> LLM:
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=128, max_model_len=256, **kw)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def check_logprobs(model_dir, adapters, prompts, names, outs, params) -> None:
    for prompt, name, out in zip(prompts, names, outs):
        assert_matches(out, prompt, params, reference(model_dir, name and adapters[name], prompt + out.token_ids))


@pytest.mark.parametrize("model", sorted(MOE_MODELS))
def test_one_batch_of_every_adapter_matches_peft(model, moe_model, peft_oracle):
    """Every request in the first forward: each expert's tokens come from several adapters and base rows."""
    model_dir, adapters = moe_model(model)
    llm = make_llm(model_dir, adapters, max_num_batched_tokens=512)
    prompts = random_prompts(len(NAMES), (5, 30), VOCAB, seed=71)
    params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, temperature=0.0, ignore_eos=True)
    outs = generate_in_one_batch(llm, prompts, NAMES, params)
    assert_matches_peft(llm, model_dir, adapters, prompts, NAMES, outs, 6, peft_oracle)
    check_logprobs(model_dir, adapters, prompts, NAMES, outs, params)
    base = [peft_oracle(model_dir, None, p, 6) for p in prompts]
    assert all(o.token_ids != b for o, b, n in zip(outs, base, NAMES) if n), "every adapter changes its output"


@pytest.mark.parametrize("model", sorted(MOE_MODELS))
def test_chunked_prefill_matches_peft(model, moe_model, peft_oracle):
    model_dir, adapters = moe_model(model)
    llm = make_llm(model_dir, adapters, max_num_batched_tokens=32)
    prompts = random_prompts(len(NAMES), (5, 30), VOCAB, seed=72)
    prompts[3] = random_prompts(1, (90, 90), VOCAB, seed=73)[0]  # 90 > the 32-token budget: 3 chunks
    params = SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=1, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, adapters=NAMES)
    assert_matches_peft(llm, model_dir, adapters, prompts, NAMES, outs, 6, peft_oracle)
    check_logprobs(model_dir, adapters, prompts, NAMES, outs, params)


@pytest.mark.parametrize("model", sorted(MOE_MODELS))
def test_preemption_and_prefix_hits_match_peft(model, moe_model, peft_oracle):
    model_dir, dirs = moe_model(model)
    adapters = {"r8_all": dirs["r8_all"], "r4_qv": dirs["r4_qv"]}
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=2, kv_cache_blocks=18, max_model_len=128)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    prompts, names, outs = generate_through_preemption_and_prefix_hits(llm, VOCAB)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 24, peft_oracle)


def test_adapter_splits_per_expert_as_peft(moe_model):
    """PEFT's ParamWrapper layout: lora_A rows expert-major, lora_B columns expert-innermost; the nested
    wrapper (base_layer.) is gate_up_proj when both are targeted."""
    import safetensors.torch

    model_dir, adapters = moe_model("mixtral")
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    adapter = load_adapter_dir(adapters["r8_all"], shape, 64)
    saved = safetensors.torch.load_file(adapters["r8_all"] / "adapter_model.safetensors")
    a = saved["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"]  # [E r, H]
    b = saved["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"]  # [2I, E r]
    w = adapter.weights[(1, "experts.2.gate_up_proj")]
    assert torch.equal(w.a, a.view(4, 8, -1)[2]) and torch.equal(w.b, b.view(b.shape[0], 8, 4)[:, :, 2])
    assert adapter.weights[(1, "experts.3.down_proj")].a.shape == (8, 48)
    assert w.scaling == 2.0


@pytest.mark.parametrize("model", sorted(MOE_MODELS))
def test_upload_and_engine_check_adapters_against_one_shape(model, moe_model):
    """The server checks an upload against ModelShape.from_hf_config, the engine loads against its own."""
    model_dir, _ = moe_model(model)
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    engine_shape = _adapter_shape(ModelConfig.from_dir(model_dir), EngineConfig.of(model=str(model_dir)))
    assert shape == engine_shape and shape.num_experts == 4
    assert shape.moe_intermediate_size == 48


def test_routing_groups_pairs_by_expert_then_slot():
    top = torch.tensor([[0, 2], [2, 1], [0, 2]])
    batch = ExpertBatch.route(top, torch.rand(3, 2), torch.tensor([1, -1, 0], dtype=torch.int32), 3, 2)
    assert batch.experts.tolist() == [0, 0, 1, 2, 2, 2] and batch.expert_bounds == (0, 2, 3, 6)
    assert batch.tokens.tolist() == [2, 0, 1, 1, 2, 0]  # within an expert: base rows, slot 0, slot 1
    assert batch.groups == ((0, 1, 0, 0), (1, 1, 0, 1), (4, 1, 2, 0), (5, 1, 2, 1))


def test_refusals_name_what_is_not_served(moe_model, tmp_path):
    model_dir, adapters = moe_model("qwen3_moe")
    cfg = json.loads((model_dir / "config.json").read_text())
    for field, value in (("decoder_sparse_step", 0), ("mlp_only_layers", [2])):
        with pytest.raises(ModelConfigError, match=field):
            ModelConfig.from_dict({**cfg, field: value})
    with pytest.raises(ModelConfigError, match="quantization 'int8' is not supported for Qwen3MoeForCausalLM"):
        LLM(model_dir, device="cpu", quantization="int8", kv_cache_blocks=16)
    shape = ModelShape.from_hf_config(cfg)
    dora = tmp_path / "dora"
    shutil.copytree(adapters["r8_all"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterFormatError, match="DoRA on MoE experts") as e:
        load_adapter_dir(dora, shape, 64)
    assert e.value.param == "use_dora"
    dense = ModelShape(2, 64, 64, 32, 128, VOCAB)
    with pytest.raises(AdapterFormatError, match="mixture-of-experts model only") as e:
        load_adapter_dir(adapters["r2_experts"], dense, 64)
    assert e.value.param == "target_parameters"


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton needs a GPU or the interpreter")
def test_qwen3_moe_through_the_triton_kernels(moe_model, peft_oracle):
    """The experts' LoRA in kernels.expert_lora_triton (the interpreter on a CPU), beside attention LoRA and
    base rows."""
    model_dir, adapters = moe_model("qwen3_moe")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(model_dir, device=device, dtype="float32", kernels="triton", max_loras=2, kv_cache_blocks=32,
              max_model_len=128)
    assert llm.engine.kernels.name == "triton"
    names = ["r8_all", None, "r2_experts"]
    for name in names[::2]:
        llm.add_adapter(name, adapters[name])
    prompts = random_prompts(3, (10, 20), VOCAB, seed=74)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), adapters=names)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 4, peft_oracle)


def test_registry_says_what_each_architecture_supports():
    from server.engine.architectures import ARCHITECTURES, architecture_refusal

    assert {a for a, s in ARCHITECTURES.items() if s.moe} == {"MixtralForCausalLM", "Qwen3MoeForCausalLM"}
    assert all(s.quantization and s.gguf and s.dora == "all" for s in ARCHITECTURES.values() if not s.moe)
    assert architecture_refusal("DbrxForCausalLM").startswith("architecture DbrxForCausalLM is not supported")
    assert "\n" not in architecture_refusal("DbrxForCausalLM")


def test_rank_and_alpha_patterns_apply_to_expert_parameters(moe_model, tmp_path, peft_oracle):
    """PEFT matches rank_pattern / alpha_pattern keys against the parameter's name (model.layers.1.mlp.experts
    .down_proj), as against a module's."""
    model_dir, _ = moe_model("mixtral")
    adapters = {"patterned": make_moe_adapter(
        model_dir, tmp_path / "patterned", 8, 16, ["q_proj"], ["experts.gate_up_proj", "experts.down_proj"], seed=49,
        rank_pattern={"layers.1.mlp.experts.down_proj": 3}, alpha_pattern={"gate_up_proj": 4})}
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    adapter = load_adapter_dir(adapters["patterned"], shape, 64)
    assert adapter.weights[(1, "experts.0.down_proj")].rank == 3
    assert adapter.weights[(0, "experts.0.down_proj")].rank == 8
    assert adapter.weights[(0, "experts.1.gate_up_proj")].scaling == 0.5
    llm = make_llm(model_dir, adapters)
    names = ["patterned", None]
    prompts = random_prompts(2, (8, 20), VOCAB, seed=75)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), adapters=names)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 5, peft_oracle)
