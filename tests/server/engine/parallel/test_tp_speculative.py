"""--speculative-config ngram under --tensor-parallel-size 2: rank 0 proposes the drafts (prompt lookup
needs no model) and the verify is an ordinary multi-token step every rank runs, so a mixed batch of
adapter and base rows generates the plain TP = 1 engine's tokens, logprobs within 1e-4, with drafts
accepted (the other methods stay refused: tests/server/engine/test_flag_refusals.py)."""
from __future__ import annotations

import pytest

from server.engine import LLM
from tests.server.engine.test_speculative_ngram import SPEC, looping, mixed_params, repetitive_prompts

KW = dict(device="cpu", dtype="float32", max_loras=2, max_model_len=256, max_num_batched_tokens=64, block_size=16,
          kv_cache_blocks=128)
NAMES = ["r8_all", None, "r4_qv", "r8_all", None, "r4_qv"]


def generate(llm: LLM, adapters: dict, prompts: list, params: list) -> list:
    for name in ("r8_all", "r4_qv"):
        llm.add_adapter(name, adapters[name])
    return llm.generate(prompts, params, adapters=NAMES)


def test_tp2_ngram_matches_plain_tp1(tiny_model_dir, tiny_adapters):
    prompts = repetitive_prompts(len(NAMES), seed=21)
    params = [mixed_params(i, False, looping(p)) for i, p in enumerate(prompts)]
    tp = LLM(tiny_model_dir, tensor_parallel_size=2, speculative_config=SPEC, **KW)
    try:
        got = generate(tp, tiny_adapters, prompts, params)
    finally:
        tp.engine.shutdown()
    want = generate(LLM(tiny_model_dir, **KW), tiny_adapters, prompts, params)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        if a.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    counters = tp.engine.scheduler.spec_counters
    assert counters.num_drafts > 0 and counters.num_accepted_tokens > 0  # drafts verified across the ranks
