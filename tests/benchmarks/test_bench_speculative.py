"""benchmarks/engine/speculative.py's parts on the tiny model: its runs time the same tokens on both
engines and count what the spec engine verified, and its grounded items are well formed."""
from __future__ import annotations

import json

import pytest

from benchmarks.engine.speculative import GROUNDED_PATH, run, sampling, spec_delta
from server.engine import LLM
from tests.server.engine.test_speculative_ngram import repetitive_prompts

pytestmark = pytest.mark.unit


def test_grounded_items_quote_extract_or_edit_their_prompt():
    items = [json.loads(line) for line in GROUNDED_PATH.read_text().splitlines()]
    assert len(items) >= 20 and len({i["id"] for i in items}) == len(items)
    assert {i["kind"] for i in items} == {"quote", "extract", "edit"}
    assert all("\n\n" in i["prompt"] for i in items), "each carries the text it is about"


def test_a_run_counts_decode_tokens_and_the_spec_engines_drafts(tiny_model_dir):
    opts = dict(device="cpu", dtype="float32", max_model_len=256, kernels="torch")
    plain = LLM(tiny_model_dir, **opts)
    spec = LLM(tiny_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3}, **opts)
    batches = [[p] for p in repetitive_prompts(2, seed=1)] + [repetitive_prompts(3, seed=2)]
    before = spec.engine.stats().speculative
    a, b = run(plain, batches, sampling(12)), run(spec, batches, sampling(12))
    assert a["outputs"] == b["outputs"] and a["decode_tokens"] == b["decode_tokens"] > 0
    assert a["decode_seconds"] > 0 and b["decode_seconds"] > 0
    delta = spec_delta(before, spec.engine.stats().speculative)
    assert delta == spec.engine.stats().speculative  # from zero: the delta is the totals
    # --json-answer: every answer under the JSON schema, the same tokens with drafts; --temperature: sampled.
    json_answer = sampling(12, json_answer=True)
    assert json_answer.structured_outputs is not None and json_answer.greedy
    a, b = run(plain, batches, json_answer), run(spec, batches, json_answer)
    assert a["outputs"] == b["outputs"]
    assert not sampling(12, temperature=0.7).greedy
