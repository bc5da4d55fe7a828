"""Adapters written against transformers 4's per-expert Linear modules (Mixtral's `experts.{e}.w1/w2/w3`,
Qwen3-MoE's `experts.{e}.gate_proj/up_proj/down_proj`), served on transformers 5's fused experts.

The installed transformers has no such modules, and PEFT converts only some such adapters itself (every
Linear targeted, at one scaling: test_agrees_with_peft_s_own_conversion), so the oracle converts: each
Linear LoRA is merged into the expert weights by hand, W_e' = W_e + scaling * B @ A (what PEFT's Linear
LoRA computes in transformers 4), and plain transformers runs the merged model. A mixed batch of base
rows, per-expert-Linear adapters (every expert and only some, gate and up at different scalings) and a
target_parameters adapter gives its greedy tokens and logprobs (float32, 1e-4)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from adapters.format import AdapterFormatError, ModelShape, inspect_adapter_bytes, load_adapter_dir
from benchmarks.engine.moe_models import MOE_MODELS, VOCAB
from server.engine import LLM, SamplingParams
from tests.engine_helpers import generate_in_one_batch, random_prompts
from tests.moe_linear_adapters import make_linear_adapter, merged_model
from tests.server.engine.test_engine_architectures import reference
from tests.server.engine.test_engine_logprobs import assert_matches
from tests.server.engine.test_engine_moe import make_llm

ARCH = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# model -> adapter name -> (r, lora_alpha, target_modules, rank_pattern, alpha_pattern): one on attention and
# every expert's three Linears (a rank and an alpha pattern: gate and up at different scalings), one on a few
# experts' single Linears.
LINEAR_ADAPTERS = {
    "mixtral": {
        "linear_all": (8, 16, ["q_proj", "v_proj", "w1", "w2", "w3"],
                       {"layers.1.block_sparse_moe.experts.2.w2": 3}, {"w3": 4}),
        "linear_some": (4, 8, ["experts.0.w1", "experts.3.w1", "layers.1.block_sparse_moe.experts.1.w2"], {}, {}),
    },
    "qwen3_moe": {
        "linear_all": (8, 16, ["q_proj", "gate_proj", "up_proj", "down_proj"],
                       {"layers.0.mlp.experts.1.down_proj": 2}, {"layers.1.mlp.experts.3.up_proj": 4}),
        "linear_some": (4, 8, ["experts.1.up_proj", "experts.2.gate_proj", "experts.2.down_proj"], {}, {}),
    },
}


@pytest.fixture(scope="module")
def linear_adapters(moe_model, tmp_path_factory):
    """linear_adapters(model) -> (model_dir, {name: adapter dir}, {name: merged model dir})."""
    cache = {}

    def get(model: str):
        if model not in cache:
            model_dir, peft_adapters = moe_model(model)
            root = tmp_path_factory.mktemp(f"linear_{model}")
            dirs, merged = {}, {}
            for i, (name, spec) in enumerate(LINEAR_ADAPTERS[model].items()):
                dirs[name] = make_linear_adapter(model_dir, peft_adapters["r2_experts"], root / name, ARCH[model],
                                                 *spec, seed=60 + i)
                merged[name] = merged_model(model_dir, dirs[name], ARCH[model], root / f"{name}_merged")
            cache[model] = model_dir, dirs, merged
        return cache[model]

    return get


@pytest.mark.parametrize("model", sorted(MOE_MODELS))
def test_per_expert_linear_adapters_match_merged_weights(model, moe_model, linear_adapters, peft_oracle):
    """One forward pass: base rows, both per-expert-Linear adapters and a target_parameters one (peft oracle)."""
    model_dir, dirs, merged = linear_adapters(model)
    peft_adapters = moe_model(model)[1]
    adapters = {**dirs, "r8_all": peft_adapters["r8_all"]}
    llm = make_llm(model_dir, adapters, max_num_batched_tokens=512)
    names = ["linear_all", None, "linear_some", "r8_all", "linear_all", "linear_some", None]
    prompts = random_prompts(len(names), (5, 30), VOCAB, seed=81)
    params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, temperature=0.0, ignore_eos=True)
    outs = generate_in_one_batch(llm, prompts, names, params)
    for prompt, name, out in zip(prompts, names, outs):
        oracle = (merged[name], None) if name in merged else (model_dir, name and adapters[name])
        expected = peft_oracle(*oracle, prompt, 6)
        assert out.token_ids == expected, f"adapter {name}: engine {out.token_ids} != oracle {expected}"
        ref = reference(*oracle, prompt + out.token_ids)
        assert_matches(out, prompt, params, ref)
        if name:  # the adapter takes effect (a few experts' gate alone may leave 6 greedy tokens as they were)
            assert (ref - reference(model_dir, None, prompt + out.token_ids)).abs().max() > 1e-2, name


def test_gate_and_up_stack_into_one_gate_up_lora(linear_adapters):
    """Mixtral: w1 (gate) and w3 (up) of an expert become one rank-r1+r3 LoRA, B block-diagonal; at different
    scalings (alpha_pattern on w3) each is folded into its B."""
    model_dir, dirs, _ = linear_adapters("mixtral")
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    adapter = load_adapter_dir(dirs["linear_all"], shape, 64)
    saved = safetensors.torch.load_file(dirs["linear_all"] / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.block_sparse_moe.experts.1.{}.lora_{}.weight"
    w = adapter.weights[(0, "experts.1.gate_up_proj")]
    assert w.rank == 16 and adapter.rank == 16 and w.scaling == 1.0
    assert torch.equal(w.a, torch.cat([saved[key.format("w1", "A")], saved[key.format("w3", "A")]]))
    assert torch.allclose(w.b[:48, :8], 2.0 * saved[key.format("w1", "B")]) and not w.b[:48, 8:].any()
    assert torch.allclose(w.b[48:, 8:], 0.5 * saved[key.format("w3", "B")]) and not w.b[48:, :8].any()
    assert adapter.weights[(1, "experts.2.down_proj")].rank == 3
    some = load_adapter_dir(dirs["linear_some"], shape, 64)
    assert set(some.weights) == {(0, "experts.0.gate_up_proj"), (1, "experts.0.gate_up_proj"),
                                 (0, "experts.3.gate_up_proj"), (1, "experts.3.gate_up_proj"),
                                 (1, "experts.1.down_proj")}
    gate_only = some.weights[(0, "experts.0.gate_up_proj")]
    assert gate_only.scaling == 2.0 and gate_only.rank == 4 and not gate_only.b[48:].any()


def _rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of adapter `src` with its tensors passed through change(dict) -> dict."""
    dst.mkdir()
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = safetensors.torch.load_file(src / "adapter_model.safetensors")
    safetensors.torch.save_file(change(tensors), dst / "adapter_model.safetensors")
    return dst


def test_refusals_name_the_module(linear_adapters, moe_model, tmp_path):
    model_dir, dirs, _ = linear_adapters("mixtral")
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    prefix = "base_model.model.model.layers.0.block_sparse_moe.experts."

    def widen(t):
        key = prefix + "3.w1.lora_A.weight"
        return t | {key: torch.zeros(4, 65)}

    with pytest.raises(AdapterFormatError, match=r"experts\.3\.w1: shape mismatch .*in_features=64, out_features=48"):
        load_adapter_dir(_rewrite(dirs["linear_some"], tmp_path / "wide", widen), shape, 64)

    def taller(t):
        key = prefix + "0.w1.lora_B.weight"
        return t | {key: torch.zeros(49, 4)}

    with pytest.raises(AdapterFormatError, match=r"experts\.0\.w1: shape mismatch"):
        load_adapter_dir(_rewrite(dirs["linear_some"], tmp_path / "tall", taller), shape, 64)

    def beyond(t):
        return t | {prefix + "4.w1.lora_A.weight": torch.zeros(4, 64),
                    prefix + "4.w1.lora_B.weight": torch.zeros(48, 4)}

    beyond_dir = _rewrite(dirs["linear_some"], tmp_path / "beyond", beyond)
    with pytest.raises(AdapterFormatError, match=r"experts\.4\.w1.* is for expert 4 but the base model has 4 "):
        load_adapter_dir(beyond_dir, shape, 64)
    with pytest.raises(AdapterFormatError, match=r"experts\.4\.w1"):  # an upload's check, from the header alone
        inspect_adapter_bytes((beyond_dir / "adapter_config.json").read_bytes(),
                              (beyond_dir / "adapter_model.safetensors").read_bytes(), shape, 64)

    def qwen_names(t):
        return {k.replace(".w1.", ".gate_proj."): v for k, v in t.items()}

    with pytest.raises(AdapterFormatError, match="unexpected tensor keys"):
        load_adapter_dir(_rewrite(dirs["linear_some"], tmp_path / "qwen_names", qwen_names), shape, 64)
    with pytest.raises(AdapterFormatError, match=r"experts\.0\.w1 and .*experts\.0\.w3: ranks 8 \+ 8 .*_rank 12"):
        load_adapter_dir(dirs["linear_all"], shape, 12)
    both = tmp_path / "both"
    _rewrite(dirs["linear_some"], both, lambda t: t | safetensors.torch.load_file(
        moe_model("mixtral")[1]["r2_experts"] / "adapter_model.safetensors"))
    config = json.loads((both / "adapter_config.json").read_text())
    (both / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": ["gate_up_proj"]}))
    with pytest.raises(AdapterFormatError, match="target_parameters together with per-expert Linear") as e:
        load_adapter_dir(both, shape, 64)
    assert e.value.param == "target_parameters"


@pytest.mark.parametrize("model", sorted(MOE_MODELS))
def test_agrees_with_peft_s_own_conversion(model, moe_model, tmp_path, peft_oracle):
    """Where PEFT converts a transformers 4 adapter itself (every expert Linear targeted, one scaling: it
    stacks gate and up at r and alpha doubled), PEFT is the oracle, and the hand-merged model agrees with it."""
    model_dir, peft_adapters = moe_model(model)
    linears = ["w1", "w2", "w3"] if model == "mixtral" else ["gate_proj", "up_proj", "down_proj"]
    adapter = make_linear_adapter(model_dir, peft_adapters["r2_experts"], tmp_path / "v4", ARCH[model], 4, 8,
                                  ["q_proj", *linears], {}, {}, seed=70)
    merged = merged_model(model_dir, adapter, ARCH[model], tmp_path / "merged")
    llm = make_llm(model_dir, {"v4": adapter})
    prompts = random_prompts(2, (8, 20), VOCAB, seed=82)
    params = SamplingParams(max_tokens=5, logprobs=2, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, adapters=["v4", None])
    for prompt, out, oracle in zip(prompts, outs, [adapter, None]):
        assert out.token_ids == peft_oracle(model_dir, oracle, prompt, 5)
        ref = reference(model_dir, oracle, prompt + out.token_ids)
        assert_matches(out, prompt, params, ref)
    merged_ref = reference(merged, None, prompts[0] + outs[0].token_ids)
    assert (reference(model_dir, adapter, prompts[0] + outs[0].token_ids) - merged_ref).abs().max() < 1e-4


def test_a_config_whose_stored_form_would_not_load_again_is_refused(linear_adapters, monkeypatch):
    """The stored config lists every targeted module by name (adapters.pattern_resolver); on a large MoE
    model a transformers 4 adapter's per-expert names could exceed the config bound a later load applies."""
    import adapters.format

    model_dir, dirs, _ = linear_adapters("mixtral")
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    config = (dirs["linear_all"] / "adapter_config.json").read_bytes()
    weights = (dirs["linear_all"] / "adapter_model.safetensors").read_bytes()
    stored = inspect_adapter_bytes(config, weights, shape, 64).canonical_config_json
    assert len(stored) > len(config)
    monkeypatch.setattr(adapters.format, "MAX_CONFIG_BYTES", len(config))
    with pytest.raises(AdapterFormatError, match="targeted modules, listed by name as stored") as e:
        inspect_adapter_bytes(config, weights, shape, 64)
    assert e.value.param == "target_modules"



@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton needs a GPU or the interpreter")
def test_stacked_gate_up_through_the_triton_kernels(linear_adapters, peft_oracle):
    """The stacked rank-16 gate_up LoRA (and the folded scalings) in kernels.expert_lora_triton."""
    model_dir, dirs, merged = linear_adapters("qwen3_moe")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(model_dir, device=device, dtype="float32", kernels="triton", max_loras=2, kv_cache_blocks=32,
              max_model_len=128)
    llm.add_adapter("linear_all", dirs["linear_all"])
    prompts = random_prompts(2, (10, 20), VOCAB, seed=83)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                        adapters=["linear_all", None])
    assert outs[0].token_ids == peft_oracle(merged["linear_all"], None, prompts[0], 4)
    assert outs[1].token_ids == peft_oracle(model_dir, None, prompts[1], 4)
