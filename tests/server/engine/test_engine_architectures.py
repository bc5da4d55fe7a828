"""Architectures beyond the Llama family (tests.fixtures_architectures): a mixed batch of adapters and
base rows through chunked prefill gives transformers + peft's greedy tokens and logprobs (float32, 1e-4);
other architectures are refused by name."""
from __future__ import annotations

import os

import pytest
import torch

from server.engine import LLM, ModelConfig, SamplingParams
from tests.engine_helpers import assert_matches_peft, random_prompts
from tests.fixtures_architectures import ARCH_MODELS
from tests.server.engine.test_engine_logprobs import assert_matches

VOCAB = 512


def reference(model_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: log_softmax of transformers (+ peft) float32 logits at every position."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.inference_mode():
        return torch.log_softmax(model.eval()(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("model", sorted(ARCH_MODELS))
def test_mixed_batch_matches_peft(model, arch_model, peft_oracle):
    model_dir, adapters = arch_model(model)
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


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton needs a GPU or the interpreter")
def test_gemma2_through_the_triton_kernels(arch_model, peft_oracle):
    """Soft-capped, windowed attention in the Triton kernels (the interpreter on a CPU): a prompt longer
    than a query tile and the window, decodes past the window, beside an adapter's row."""
    model_dir, adapters = arch_model("gemma2")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(model_dir, device=device, dtype="float32", kernels="triton", max_loras=1, kv_cache_blocks=32,
              max_model_len=128)
    assert llm.engine.kernels.name == "triton"
    llm.add_adapter("dora_r16", adapters["dora_r16"])
    names = ["dora_r16", None]
    prompts = random_prompts(2, (20, 40), VOCAB, seed=46)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), adapters=names)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 5, peft_oracle)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForConditionalGeneration"])
def test_other_architectures_are_refused_by_name(arch):
    cfg = {"architectures": [arch], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match=f"architecture {arch} is not supported"):
        ModelConfig.from_dict(cfg)


def test_partial_rotary_is_refused():
    cfg = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2,
           "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.75}}
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        ModelConfig.from_dict(cfg)
