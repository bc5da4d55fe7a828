"""GGUF files of llama.cpp's qwen3, phi3, gemma2 and gemma3 architectures (tests.server.test_gguf's writer,
float32 so that nothing is lost): converted by loraplex, they serve what transformers + peft compute on
the Hugging Face model they were written from, an adapter's rows and base rows alike."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from server.demo import PHI3_MODULES, SEVEN, make_adapter, make_base_model
from server.engine import LLM, ModelConfig
from server.gguf_convert import ensure_converted
from tests.engine_helpers import assert_matches_peft, greedy, random_prompts
from tests.server.test_gguf import write_gguf

VOCAB = 512
# What a GGUF can carry: no query_pre_attn_scalar (llama.cpp derives it), Gemma 3's layer pattern fixed at 6.
MODELS = {"qwen3": {}, "phi3": {},
          "gemma2": dict(sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                         query_pre_attn_scalar=16),
          "gemma3": dict(sliding_window=8, query_pre_attn_scalar=16)}


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_gguf_round_trip_serves_what_peft_computes(arch, tmp_path, peft_oracle):
    model_dir = make_base_model(tmp_path / "hf", arch, hidden_size=64, num_layers=6 if arch == "gemma3" else 2,
                                num_heads=4, num_kv_heads=2, intermediate_size=128, config_overrides=MODELS[arch])
    path = write_gguf(model_dir, tmp_path / f"tiny-{arch}.F32.gguf", arch, quantize=False)
    converted = ensure_converted(path, tmp_path / "models", lambda line: None)
    ours, theirs = ModelConfig.from_dir(converted), ModelConfig.from_dir(model_dir)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # a float32 in the file
    assert replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs, json.loads((converted / "config.json").read_text())
    adapters = {"a": make_adapter(model_dir, tmp_path / "a", r=8, seed=51,
                                  target_modules=PHI3_MODULES if arch == "phi3" else SEVEN)}
    llm = LLM(converted, device="cpu", dtype="float32", max_loras=1, kv_cache_blocks=32, max_model_len=128)
    llm.add_adapter("a", adapters["a"])
    names = ["a", None, "a"]
    prompts = random_prompts(3, (6, 30), VOCAB, seed=52)
    outs = llm.generate(prompts, greedy(6), adapters=names)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 6, peft_oracle)
