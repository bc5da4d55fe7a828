"""The engine's greedy tokens equal transformers + peft's, request by request, in mixed batches."""
from __future__ import annotations

import pytest

from adapters.format import AdapterFormatError
from server.engine import LLM, RequestError, SamplingParams
from tests.engine_helpers import assert_matches_peft, generate_in_one_batch, greedy, random_prompts

pytestmark = pytest.mark.unit

VOCAB = 512


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tiny_adapters):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=256, max_model_len=512)
    for name, path in tiny_adapters.items():
        llm.add_adapter(name, path)
    return llm


def test_mixed_adapters_and_base_rows_match_peft(llm, tiny_model_dir, tiny_adapters, peft_oracle):
    names = [None, *tiny_adapters] * 4  # 20 requests: 4 adapters of ranks 4..32 plus base rows
    prompts = random_prompts(len(names), (3, 40), VOCAB, seed=1)
    outs = generate_in_one_batch(llm, prompts, names, greedy(8))
    assert_matches_peft(llm, tiny_model_dir, tiny_adapters, prompts, names, outs, 8, peft_oracle)
    assert llm.engine.stats().kv_blocks.used == 0


def test_generate_api_with_text_prompts(llm, tiny_model_dir, tiny_adapters, peft_oracle):
    texts = ["Hello there, how are you?", "The quick brown fox", "def main():\n    return 1"]
    names = ["r8_all", None, "r16_rslora"]
    outs = llm.generate(texts, greedy(6), adapters=names)
    prompts = [llm.tokenizer(t).input_ids for t in texts]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert_matches_peft(llm, tiny_model_dir, tiny_adapters, prompts, names, outs, 6, peft_oracle)
    assert all(o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs)


def test_adapter_changes_output(llm):
    prompt = random_prompts(1, (20, 20), VOCAB, seed=5)[0]
    outs = llm.generate([prompt, prompt], greedy(8), adapters=[None, "r8_all"])
    assert outs[0].token_ids != outs[1].token_ids


def test_readding_a_name_serves_the_new_weights(llm, tiny_adapters, tiny_model_dir, peft_oracle):
    prompt = random_prompts(1, (12, 12), VOCAB, seed=9)[0]
    llm.add_adapter("swap", tiny_adapters["r4_qv"])
    first = llm.generate([prompt], greedy(6), adapters=["swap"])[0]
    llm.add_adapter("swap", tiny_adapters["r32_pattern"])
    second = llm.generate([prompt], greedy(6), adapters=["swap"])[0]
    assert first.token_ids == peft_oracle(tiny_model_dir, tiny_adapters["r4_qv"], prompt, 6)
    assert second.token_ids == peft_oracle(tiny_model_dir, tiny_adapters["r32_pattern"], prompt, 6)
    llm.remove_adapter("swap")


@pytest.mark.parametrize(
    "setup, reason",
    [
        ("no_config", "adapter_config.json"),
        ("pickle_only", "pickle"),
        ("dora", "lora_magnitude_vector"),
        ("rank", "max_lora_rank"),
    ],
)
def test_refused_adapter_leaves_engine_serving(llm, tiny_adapters, tmp_path, setup, reason):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_adapters["r8_all"], bad)
    if setup == "no_config":
        (bad / "adapter_config.json").unlink()
    elif setup == "pickle_only":
        (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")
    elif setup == "dora":
        cfg = json.loads((bad / "adapter_config.json").read_text())
        cfg["use_dora"] = True
        (bad / "adapter_config.json").write_text(json.dumps(cfg))
    elif setup == "rank":
        bad = tiny_adapters["r32_pattern"]
    prompt = random_prompts(1, (10, 10), VOCAB, seed=3)[0]
    before = llm.generate([prompt], greedy(5), adapters=["r8_all"])[0].token_ids
    with pytest.raises(AdapterFormatError, match=f"(?i){reason}"):
        if setup == "rank":
            from adapters.format import load_adapter_dir

            load_adapter_dir(bad, llm.engine.adapter_shape, max_lora_rank=16)
        else:
            llm.add_adapter("bad", bad)
    assert "bad" not in llm._versions
    assert llm.generate([prompt], greedy(5), adapters=["r8_all"])[0].token_ids == before


def test_rank_above_engine_bound_is_refused(tiny_model_dir, tiny_adapters):
    llm = LLM(tiny_model_dir, device="cpu", max_loras=2, max_lora_rank=16, kv_cache_blocks=64, max_model_len=256)
    with pytest.raises(AdapterFormatError, match="max_lora_rank"):
        llm.add_adapter("big", tiny_adapters["r32_pattern"])
    llm.add_adapter("ok", tiny_adapters["r16_rslora"])
    assert len(llm.generate([[5, 6, 7]], greedy(3), adapters=["ok"])[0].token_ids) == 3


def test_bad_requests_are_refused(llm):
    with pytest.raises(RequestError, match="max_model_len"):
        llm.engine.add_request("long", list(range(3, 503)), SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match="token ids"):
        llm.engine.add_request("oob", [5, 99999], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="empty"):
        llm.engine.add_request("empty", [], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="not loaded"):
        llm.engine.add_request("ghost", [5, 6], SamplingParams(max_tokens=2), version_id="nope@1")
    with pytest.raises(ValueError, match="unknown adapter"):
        llm.generate([[5, 6]], greedy(2), adapters=["nope"])
    assert not llm.engine.has_unfinished_requests()
