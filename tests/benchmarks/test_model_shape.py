"""--model-shape smol135: the builder writes a model that transformers and loraplex both load and
agree on, with a tokenizer whose 49152 ids all decode (fewer layers here; the same code path)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from benchmarks.model_shape import SMOL135, ModelShapeError, build_model_shape, extend_vocab

PROMPT = [0, 261, 78, 377, 493, 311, 40, 41]


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    return build_model_shape("smol135", tmp_path_factory.mktemp("smol") / "model", num_layers=2)


def test_config_has_the_smollm_135m_shape(smol_dir):
    cfg = json.loads((smol_dir / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert cfg[key] == SMOL135[key]
    assert cfg["num_hidden_layers"] == 2 and cfg["tie_word_embeddings"] is True
    with safe_open(str(smol_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").shape == (49152, 576)
    assert "lm_head.weight" not in keys  # tied, as SmolLM ships it


def test_every_id_decodes_and_text_round_trips(smol_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    assert len(tok) == 49152
    texts = tok.batch_decode([[i] for i in range(49152)])
    assert all(texts[i] for i in range(3, 49152))
    assert texts[49151] == "<x49151>"
    ids = tok("The quick brown fox").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "The quick brown fox"


def test_transformers_and_loraplex_agree_on_greedy_tokens(smol_dir):
    from transformers import AutoModelForCausalLM

    from server.engine import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])  # [1, P]
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                          min_new_tokens=8, eos_token_id=None, pad_token_id=2)
    expected = out[0, len(PROMPT):].tolist()
    llm = LLM(model=str(smol_dir), device="cpu", dtype="float32", kv_cache_blocks=32, max_model_len=128)
    got = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    assert list(got) == expected
    assert len(set(expected)) > 1  # decisive weights: not one token echoed forever


def test_rebuilding_reuses_a_complete_directory(smol_dir):
    stamp = (smol_dir / "model.safetensors").stat().st_mtime_ns
    assert build_model_shape("smol135", smol_dir, num_layers=2) == smol_dir
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_unknown_shapes_and_bad_layer_counts_are_refused(tmp_path):
    with pytest.raises(ModelShapeError, match="unknown"):
        build_model_shape("llama-70b", tmp_path)
    with pytest.raises(ModelShapeError):
        build_model_shape("smol135", tmp_path, num_layers=0)


def test_extend_vocab_refuses_to_shrink(smol_dir, tmp_path):
    copy = tmp_path / "tokenizer.json"
    copy.write_text((smol_dir / "tokenizer.json").read_text())
    with pytest.raises(ModelShapeError):
        extend_vocab(copy, 1000)
