"""Speculative decoding over the four kinds of rows in one batch, with each method: base, plain LoRA,
DoRA and activated LoRA (half the aLoRA prompts holding their invocation sequence) give the plain
engine's greedy tokens, and transformers + peft's tokens with logprobs within 1e-4 (float32), prompts
long enough to be prefilled in chunks beside verify steps. A draft model that is the served model
itself has every base row's drafts accepted; the adapters' rows see theirs rejected where the adapter
changes the choice, so both verification paths run on every kind of row.
"""
from __future__ import annotations

import pytest

from server.engine import LLM, SamplingParams
from tests.server.engine.lora.test_engine_adapter_kinds import KINDS, _prompt, adapter_dirs, reference  # noqa: F401
from tests.server.engine.test_engine_logprobs import assert_matches
from tests.server.engine.test_speculative_medusa import random_heads

pytestmark = pytest.mark.unit


def speculative_config(method: str, model_dir, tmp_path) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
                "disable_by_batch_size": 64}
    if method == "medusa":
        return {"method": "medusa", "model": str(random_heads(tmp_path / "heads")), "num_speculative_tokens": 3,
                "disable_by_batch_size": 64}
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}


@pytest.mark.parametrize("method", ["ngram", "medusa", "draft_model"])
def test_base_lora_dora_and_alora_rows_speculate_and_match_the_plain_engine_and_peft(
        tiny_model_dir, adapter_dirs, reference, tmp_path, method):  # noqa: F811
    opts = dict(device="cpu", dtype="float32", max_loras=8, kv_cache_blocks=256, max_model_len=256,
                max_num_batched_tokens=64, block_size=16, kernels="torch")
    plain = LLM(tiny_model_dir, **opts)
    spec = LLM(tiny_model_dir, speculative_config=speculative_config(method, tiny_model_dir, tmp_path), **opts)
    for llm in (plain, spec):
        for name in KINDS[1:]:
            llm.add_adapter(name, adapter_dirs[name])
    n = 2 * len(KINDS) * 2  # every kind four times, aLoRA invoked twice
    names = [KINDS[i % len(KINDS)] for i in range(n)]
    prompts = [_prompt(i) for i in range(n)]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = [llm.generate(prompts, p, adapters=names) for llm in (plain, spec)]
    for a, b in zip(*outs, strict=True):
        assert b.token_ids == a.token_ids
    for prompt, name, out in zip(prompts, names, outs[1]):
        assert_matches(out, prompt, p, reference(name, prompt, prompt + out.token_ids))
    processor = spec.engine.output_processor
    assert processor.num_draft_tokens > 0
    if method == "draft_model":
        assert processor.num_accepted_tokens > 0 and processor.num_draft_tokens > processor.num_accepted_tokens
