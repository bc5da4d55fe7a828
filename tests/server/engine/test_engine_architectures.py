"""Architectures beyond the Llama family (tests.fixtures_architectures): a mixed batch of adapters and
base rows through chunked prefill gives transformers + peft's greedy tokens and logprobs (float32, 1e-4);
other architectures are refused by name."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import safetensors.torch
import torch

from server.demo import make_adapter
from server.engine import LLM, ModelConfig, SamplingParams
from tests.engine_helpers import assert_matches_peft, generate_through_preemption_and_prefix_hits, random_prompts
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


@pytest.mark.parametrize("model", sorted(ARCH_MODELS))
def test_preemption_and_prefix_hits_match_peft(model, arch_model, peft_oracle):
    """8 sequences of ~50 + 24 tokens in 18 blocks of 16 (preempted), sharing a 33-token prefix (cache hits):
    Gemma's windowed layers read the recomputed and the cached blocks alike."""
    model_dir, dirs = arch_model(model)
    adapters = {"r8_all": dirs["r8_all"], "r4_qv": dirs["r4_attn"]}  # the names the helper asks for
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=2, kv_cache_blocks=18, max_model_len=128)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    prompts, names, outs = generate_through_preemption_and_prefix_hits(llm, VOCAB)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 24, peft_oracle)


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


def unfused_llama(phi3_dir, out):
    """The Phi-3 model in the Llama layout, as a converter writes it: q/k/v and gate/up split, same math."""
    out.mkdir()
    for f in phi3_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((phi3_dir / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False)
    (out / "config.json").write_text(json.dumps(cfg))
    q, kv, inter = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"], \
        cfg["intermediate_size"]
    tensors = {}
    for key, w in safetensors.torch.load_file(phi3_dir / "model.safetensors").items():
        if key.endswith("qkv_proj.weight"):
            for name, part in zip("qkv", w.split([q, kv, kv])):
                tensors[key.replace("qkv_proj", f"{name}_proj")] = part.contiguous()
        elif key.endswith("gate_up_proj.weight"):
            for name, part in zip(("gate", "up"), w.split([inter, inter])):
                tensors[key.replace("gate_up_proj", f"{name}_proj")] = part.contiguous()
        else:
            tensors[key] = w
    safetensors.torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_phi3_adapter_with_split_names(arch_model, tmp_path, peft_oracle):
    """An adapter trained on the converted (Llama-layout) Phi-3, q_proj/v_proj/gate_proj by name, served on
    the Phi-3 itself: each feeds its rows of the fused projection, as PEFT on the converted model computes."""
    phi3_dir, _ = arch_model("phi3")
    llama_dir = unfused_llama(phi3_dir, tmp_path / "llama")
    adapters = {"split": make_adapter(llama_dir, tmp_path / "split", r=8, seed=47,
                                      target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"))}
    llm = LLM(phi3_dir, device="cpu", dtype="float32", max_loras=1, kv_cache_blocks=32, max_model_len=128)
    llm.add_adapter("split", adapters["split"])
    names = ["split", None]
    prompts = random_prompts(2, (5, 30), VOCAB, seed=48)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), adapters=names)
    assert_matches_peft(llm, llama_dir, adapters, prompts, names, outs, 6, peft_oracle)
    assert [o.token_ids for o in outs] != [peft_oracle(phi3_dir, None, p, 6) for p in prompts]  # the adapter acts


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM", "Gemma3ForConditionalGeneration"])
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
