"""Speculative decoding's adaptive k, its batch-size cut-off and the per-request opt-out: each changes
how many drafts run, never the tokens (the plain engine's, as in test_speculative_ngram)."""
from __future__ import annotations

import pytest

from server.engine import LLM, SamplingParams
from server.engine.draft_length import MAX_REST, DraftLength
from server.engine.speculative_config import (AUTO_DISABLE_BY_BATCH_SIZE, parse_speculative_config,
                                              resolve_disable_by_batch_size)
from tests.server.engine.test_speculative_ngram import assert_same, looping, repetitive_prompts

pytestmark = pytest.mark.unit

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_k_grows_on_full_acceptance_and_drops_to_the_accepted_run():
    d = DraftLength(4)
    assert d.next_k() == 4
    d.verified(4, 2)
    assert d.next_k() == 3  # two accepted, then the miss: three next
    d.verified(3, 3)
    d.verified(4, 4)
    assert d.next_k() == 4  # grown back, never past the configured k
    d.verified(2, 2)  # the proposer had only two: all accepted still counts as a hit
    assert d.next_k() == 4


def test_a_sequence_whose_drafts_keep_failing_rests_longer_each_time_and_recovers():
    d = DraftLength(4)
    rests = []
    for _ in range(8):
        d.verified(d.next_k(), 0)
        rest = 0
        while d.next_k() == 0:
            rest += 1
        rests.append(rest)
    assert rests == [0, 1, 3, 7, 15, 31, MAX_REST, MAX_REST]
    d.verified(1, 1)  # a hit: back to growing, no rest
    assert d.next_k() == 2 and d.misses == 0


def test_k_after_foretells_next_k_without_changing_the_length():
    """Medusa drafts only the heads the next step takes: k_after(drafted, accepted) is what next_k()
    returns once verified(drafted, accepted) (or no verify, drafted 0) has run."""
    import copy
    import random

    rng = random.Random(0)
    d = DraftLength(4)
    for _ in range(300):
        drafted = d.next_k()
        accepted = rng.choice([0, 0, 0, drafted, rng.randint(0, drafted)]) if drafted else 0
        before = copy.copy(d.__dict__)
        foretold = d.k_after(drafted, accepted)
        assert d.__dict__ == before
        if drafted:
            d.verified(drafted, accepted)
        assert copy.copy(d).next_k() == foretold


def test_disable_by_batch_size_defaults_by_device_and_is_overridable():
    auto = parse_speculative_config({**SPEC})
    assert auto.disable_by_batch_size is None
    assert resolve_disable_by_batch_size(auto, "cpu").disable_by_batch_size == AUTO_DISABLE_BY_BATCH_SIZE["cpu"]
    assert resolve_disable_by_batch_size(auto, "cuda").disable_by_batch_size == AUTO_DISABLE_BY_BATCH_SIZE["cuda"]
    given = parse_speculative_config({**SPEC, "disable_by_batch_size": 3})
    assert resolve_disable_by_batch_size(given, "cpu").disable_by_batch_size == 3
    for bad in (1, 0, "4", True):
        with pytest.raises(ValueError, match="disable_by_batch_size"):
            parse_speculative_config({**SPEC, "disable_by_batch_size": bad})


def test_the_engine_resolves_the_cut_off_for_its_device(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_model_len=128, kernels="torch",
              speculative_config=SPEC)
    assert llm.engine.scheduler.config.speculative.disable_by_batch_size == AUTO_DISABLE_BY_BATCH_SIZE["cpu"]


def engines(model_dir, spec: dict) -> tuple[LLM, LLM]:
    opts = dict(device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=128, block_size=16,
                kernels="torch")
    return LLM(model_dir, **opts), LLM(model_dir, speculative_config=spec, **opts)


def greedy(prompt: list[int], **kw) -> SamplingParams:
    return SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logit_bias=looping(prompt), **kw)


def test_a_batch_at_the_cut_off_runs_without_drafts_and_a_smaller_one_speculates(tiny_model_dir):
    plain, spec = engines(tiny_model_dir, {**SPEC, "disable_by_batch_size": 3})
    prompts = repetitive_prompts(3, seed=11)
    outs = [llm.generate(prompts, [greedy(p) for p in prompts]) for llm in (plain, spec)]
    assert_same(*outs)
    stats = spec.engine.stats().speculative
    # Three running from the first decode step to the last (the same max_tokens): every step skipped.
    assert stats.skipped_steps > 0 and stats.num_drafts == 0
    outs = [llm.generate(prompts[:2], [greedy(p) for p in prompts[:2]]) for llm in (plain, spec)]
    assert_same(*outs)
    after = spec.engine.stats().speculative
    assert after.skipped_steps == stats.skipped_steps and after.num_accepted_tokens > 0


def test_rejected_drafts_shrink_k_and_the_output_stays_the_plain_engines(tiny_model_dir):
    # No logit bias: the tiny random model does not copy its repetitive prompt, so most drafts fail.
    plain, spec = engines(tiny_model_dir, {**SPEC, "disable_by_batch_size": 64})
    prompts = repetitive_prompts(6, seed=12)
    ps = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert_same(*(llm.generate(prompts, ps) for llm in (plain, spec)))
    s = spec.engine.stats().speculative
    assert s.num_drafts > 0 and s.acceptance_rate < 0.5
    # A fixed k would verify 4 drafts per step (the proposer finds them in the motif): adapted, fewer.
    assert s.num_draft_tokens < SPEC["num_speculative_tokens"] * s.num_drafts
    assert not spec.engine.scheduler.draft_lengths, "finished sequences keep no draft state"


def test_a_request_that_opts_out_runs_no_drafts_beside_one_that_does(tiny_model_dir):
    plain, spec = engines(tiny_model_dir, {**SPEC, "disable_by_batch_size": 64})
    prompt = repetitive_prompts(1, seed=13)[0]
    opted_out = [greedy(prompt, speculative=False)]
    assert_same(*(llm.generate([prompt], opted_out) for llm in (plain, spec)))
    assert spec.engine.stats().speculative.num_drafts == 0
    assert_same(*(llm.generate([prompt, prompt], [greedy(prompt, speculative=False), greedy(prompt)])
                  for llm in (plain, spec)))
    assert spec.engine.stats().speculative.num_accepted_tokens > 0
    with pytest.raises(ValueError, match="speculative must be true or false"):
        SamplingParams(speculative="no")
