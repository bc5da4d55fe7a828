"""Speculative decoding within --max-num-batched-tokens: each step's verify tokens (the last token and the
drafts) and a draft model's work (its catch-up over the tokens it has not seen, one token per draft pass)
together stay within the budget; k shrinks to fit, and where not one draft fits the draft catches up as
far as the budget holds, without drafts. Outputs stay the plain engine's."""
from __future__ import annotations

import pytest

from server.engine import LLM, SamplingParams
from tests.server.engine.test_speculative_draft_model import OPTS, spec
from tests.server.engine.test_speculative_medusa import prompts_of
from tests.server.engine.test_speculative_ngram import assert_same

pytestmark = pytest.mark.unit

BUDGET = 16


def pair(model_dir, adapters) -> tuple[LLM, LLM]:
    opts = {**OPTS, "max_num_batched_tokens": BUDGET, "kv_cache_blocks": 128}
    plain = LLM(model_dir, **opts)
    drafted = LLM(model_dir, speculative_config=spec(model_dir), **opts)
    for llm in (plain, drafted):
        llm.add_adapter("r8_all", adapters["r8_all"])
    return plain, drafted


def record_steps(drafted: LLM) -> list[tuple[int, int, list[int]]]:
    """Per step from now on: (the target's tokens, the draft model's tokens, the draft counts)."""
    scheduler = drafted.engine.scheduler
    proposer = scheduler.draft_model
    steps: list[tuple[int, int, list[int]]] = []  # per step: (target tokens, draft tokens, draft lengths)
    forward, schedule = proposer._forward, scheduler.schedule

    def counted_forward(seqs, starts, chunks, logits):
        target, draft, lengths = steps[-1]
        steps[-1] = (target, draft + sum(map(len, chunks)), lengths)
        return forward(seqs, starts, chunks, logits)

    def recorded_schedule():
        steps.append((0, 0, []))
        batch = schedule()
        _, draft, _ = steps[-1]
        steps[-1] = (sum(batch.num_tokens), draft, [len(d) for d in batch.drafts if d])
        return batch

    proposer._forward = counted_forward
    scheduler.schedule = recorded_schedule
    return steps


def test_draft_and_verify_tokens_stay_within_the_token_budget(tiny_model_dir, tiny_adapters):
    plain, drafted = pair(tiny_model_dir, tiny_adapters)
    steps = record_steps(drafted)
    prompts = [q[:8] for q in prompts_of(4, seed=21)]  # short: the draft's catch-up of a prompt fits too
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    names = [None, "r8_all"] * 2
    assert_same(plain.generate(prompts, p, adapters=names), drafted.generate(prompts, p, adapters=names))
    assert all(target + draft <= BUDGET for target, draft, _ in steps), steps
    speculated = [s for s in steps if s[2]]
    assert speculated and any(draft for _, draft, _ in speculated)
    # k = 4 each would take 4 x (5 verify + 4 draft) tokens: the budget held fewer drafts in some step.
    assert any(len(lengths) < 4 or min(lengths) < 4 for _, _, lengths in speculated if len(lengths) > 1), steps
    counters = drafted.engine.scheduler.spec_counters.snapshot()
    assert counters.num_accepted_tokens > 0


def test_a_prompt_longer_than_the_budget_is_caught_up_over_steps_then_drafts(tiny_model_dir, tiny_adapters):
    """40 prompt tokens, a budget of 16: the draft's catch-up runs 15 tokens a step beside the decode
    token, without drafts, until it fits with one; from then on the sequence drafts."""
    plain, drafted = pair(tiny_model_dir, tiny_adapters)
    steps = record_steps(drafted)
    prompt = [q * 3 for q in prompts_of(1, seed=5)][0][:40]
    assert len(prompt) == 40
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for name in (None, "r8_all"):
        steps.clear()
        assert_same(plain.generate([prompt], p, adapters=[name]), drafted.generate([prompt], p, adapters=[name]))
        assert all(target + draft <= BUDGET for target, draft, _ in steps), steps
        caught_up = [draft for target, draft, lengths in steps if target == 1 and draft]
        assert caught_up and max(caught_up) == BUDGET - 1, steps  # catch-up alone, as far as the budget holds
        assert any(lengths for _, _, lengths in steps), "the sequence never drafted"
    assert drafted.engine.scheduler.spec_counters.snapshot().num_accepted_tokens > 0
