"""Architectures beyond the Llama family, each a tiny random transformers model with random PEFT
adapters (every module PEFT can target in it; one DoRA): a mixed batch of adapters and base rows
through chunked prefill gives transformers + peft's greedy tokens and logprobs (float32, 1e-4)."""
from __future__ import annotations

import pytest
import torch

from server.demo import PHI3_MODULES, SEVEN, make_adapter, make_base_model
from server.engine import LLM, ModelConfig, SamplingParams
from tests.engine_helpers import assert_matches_peft, random_prompts
from tests.server.engine.test_engine_logprobs import assert_matches

VOCAB = 512
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# arch -> (make_base_model's arch, its config_overrides, rope_scaling)
MODELS = {
    "qwen3": ("qwen3", {}, None),
    "qwen3-yarn": ("qwen3", {}, YARN),
}


def targets(arch: str) -> tuple[str, ...]:
    return PHI3_MODULES if arch == "phi3" else SEVEN


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(model) -> (model_dir, {adapter name: dir}), each built once."""
    cache: dict = {}

    def get(model: str):
        if model not in cache:
            arch, overrides, rope = MODELS[model]
            root = tmp_path_factory.mktemp(model)
            model_dir = make_base_model(root / "base", arch, hidden_size=64, num_layers=2, num_heads=4,
                                        num_kv_heads=2, intermediate_size=128, rope_scaling=rope,
                                        config_overrides=overrides)
            every = targets(arch)
            adapters = {
                "r8_all": make_adapter(model_dir, root / "r8_all", r=8, target_modules=every, seed=41),
                "r4_attn": make_adapter(model_dir, root / "r4_attn", r=4, lora_alpha=8, use_rslora=True,
                                        target_modules=every[: len(every) // 2], seed=42),
                "dora_r16": make_adapter(model_dir, root / "dora_r16", r=16, lora_alpha=16, target_modules=every,
                                         seed=43, use_dora=True),
            }
            cache[model] = model_dir, adapters
        return cache[model]

    return get


def reference(model_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: log_softmax of transformers (+ peft) float32 logits at every position."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.inference_mode():
        return torch.log_softmax(model.eval()(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_mixed_batch_matches_peft(model, built, peft_oracle):
    model_dir, adapters = built(model)
    assert ModelConfig.from_dir(model_dir).architecture.lower().startswith(MODELS[model][0].rstrip("0123456789"))
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=3, kv_cache_blocks=128, max_model_len=256,
              max_num_batched_tokens=32)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    names = ["r8_all", None, "r4_attn", "dora_r16", None, "r8_all"]
    prompts = random_prompts(len(names), (5, 30), VOCAB, seed=44)
    prompts[3] = random_prompts(1, (90, 90), VOCAB, seed=45)[0]  # 90 > the 32-token budget: 3 chunks
    params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, adapters=names)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 6, peft_oracle)
    for prompt, name, out in zip(prompts, names, outs):
        assert_matches(out, prompt, params, reference(model_dir, name and adapters[name], prompt + out.token_ids))


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForConditionalGeneration"])
def test_other_architectures_are_refused_by_name(arch):
    cfg = {"architectures": [arch], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match=f"architecture {arch} is not supported"):
        ModelConfig.from_dict(cfg)
