"""Grammar masks filled ahead on the mask lane (server.engine.mask_lane): outputs are those of the
old synchronous fill token for token (the same engine with every fill run inline on the engine thread,
as the step used to), whatever the fills' timing does to the batches; a slow grammar stalls only its
own request; past its mask budget a request ends with an error naming its constraint."""
from __future__ import annotations

import random
import time
from concurrent.futures import Future

import pytest

from server.engine import LLM, SamplingParams, StructuredOutputsParams
from tests.engine_helpers import random_prompts
from tests.server.engine.test_engine_structured import CHOICES, EBNF, REGEX, SCHEMA

VOCAB = 512
CONSTRAINTS = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
               StructuredOutputsParams(grammar=EBNF), StructuredOutputsParams(choice=list(CHOICES)), None]


class _Inline:
    """The old synchronous fill: each fill runs at once on the engine thread."""

    def submit(self, tenant, fn) -> Future:
        future: Future = Future()
        future.set_result(fn())
        return future


class _Delayed:
    """The real pool, each fill started after a pause: choices sit out steps, batches change."""

    def __init__(self, pool, pauses) -> None:
        self.pool, self.pauses = pool, pauses

    def submit(self, tenant, fn) -> Future:
        pause = self.pauses()
        return self.pool.submit(tenant, lambda: (time.sleep(pause), fn())[1])


def _llm(tiny_model_dir, **kwargs) -> LLM:
    return LLM(tiny_model_dir, device="cpu", max_model_len=256, **kwargs)


def _requests(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts(n, (5, 40), VOCAB, seed=seed)
    params = []
    for i in range(n):
        so = CONSTRAINTS[i % len(CONSTRAINTS)]
        if i % 3 == 2:  # seeded sampling: each draw depends on its own row alone, so forks compare too
            params.append(SamplingParams(max_tokens=40, temperature=1.0, seed=i, n=3, structured_outputs=so))
        else:
            params.append(SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so))
    return prompts, params


def _texts(outs) -> list[list[tuple[list[int], str]]]:
    return [[(list(c.token_ids), c.finish_reason) for c in out.outputs] for out in outs]


@pytest.mark.parametrize(("kv_cache_blocks", "async_scheduling"), [(512, False), (24, False), (512, True)],
                         ids=["roomy", "preempting", "async-scheduling"])
def test_outputs_match_the_synchronous_fill_token_for_token(tiny_model_dir, kv_cache_blocks, async_scheduling):
    """Async scheduling overlaps only steps without a constrained row (server.engine.async_step): a
    constrained choice sitting out leaves its neighbours' steps to overlap, with the same tokens."""
    prompts, params = _requests(15, seed=43)
    inline = _llm(tiny_model_dir, kv_cache_blocks=kv_cache_blocks)
    inline.engine.grammars.lane.pool = _Inline()
    expected = _texts(inline.generate(prompts, params))
    lane = _llm(tiny_model_dir, kv_cache_blocks=kv_cache_blocks, async_scheduling=async_scheduling)
    rng = random.Random(7)
    lane.engine.grammars.lane.pool = _Delayed(lane.engine.grammars.lane.pool, lambda: rng.choice([0, 0, 0.002, 0.02]))
    assert _texts(lane.generate(prompts, params)) == expected
    stats = lane.engine.stats()
    assert stats.num_preemptions > 0 if kv_cache_blocks == 24 else True
    assert stats.async_steps > 0 if async_scheduling else True


def test_a_slow_mask_stalls_only_its_own_request(tiny_model_dir):
    llm = _llm(tiny_model_dir, kv_cache_blocks=128)
    engine = llm.engine
    engine.grammars.lane.pool = _Delayed(engine.grammars.lane.pool, lambda: 0.3)
    slow = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                          structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    engine.add_request("constrained", [5, 6, 7], slow)
    engine.add_request("plain", [8, 9, 10], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    longest, done = 0.0, {}
    while "plain" not in done:
        start = time.perf_counter()
        for out in engine.step():
            if out.finished or out.request_id == "constrained":
                done[out.request_id] = out
        longest = max(longest, time.perf_counter() - start)
    assert len(done["plain"].token_ids) == 30
    # a token per 0.3 s fill at most, meanwhile
    assert "constrained" not in done or len(done["constrained"].token_ids) < 15
    assert longest < 0.25, f"a step took {longest:.2f} s: it waited on the grammar"
    engine.abort_request("constrained")


@pytest.mark.parametrize("budget", [dict(max_mask_fill_seconds=1e-9), dict(max_mask_seconds_per_request=1e-9)],
                         ids=["one-fill", "total"])
def test_a_request_past_its_mask_budget_ends_naming_its_constraint(tiny_model_dir, budget):
    llm = _llm(tiny_model_dir, kv_cache_blocks=128, **budget)
    grammar = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputsParams(grammar=EBNF))
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    costly, other = llm.generate([[5, 6, 7], [8, 9]], [grammar, plain])
    assert costly.finish_reason == "error" and costly.error_is_client
    assert "grammar constraint is too costly" in costly.error and "simplify it" in costly.error
    assert other.finish_reason == "length" and len(other.token_ids) == 20 and not other.error_is_client


def test_a_fill_running_far_past_its_cap_ends_the_request_without_waiting_for_it(tiny_model_dir):
    llm = _llm(tiny_model_dir, kv_cache_blocks=128, max_mask_fill_seconds=0.01)
    llm.engine.grammars.lane.pool = _Delayed(llm.engine.grammars.lane.pool, lambda: 2.0)  # sleeps: no CPU time
    start = time.perf_counter()
    out, = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
        regex="[a-z]+")))
    assert out.finish_reason == "error" and out.error_is_client and "regex constraint" in out.error
    assert time.perf_counter() - start < 1.5


def test_a_requests_choices_share_one_mask_account(tiny_model_dir):
    grammars = _llm(tiny_model_dir, kv_cache_blocks=16).engine.grammars
    compiled = grammars.compile(StructuredOutputsParams(regex=REGEX))
    first = grammars.choice_matcher(compiled, "regex", None)
    second = grammars.choice_matcher(compiled, "regex", first)
    other = grammars.choice_matcher(compiled, "regex", None)
    deadline = time.monotonic() + 30
    while not (first.ready and second.ready and other.ready):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert first.spend is second.spend is not other.spend
    assert first.spend.seconds > 0 and other.spend.seconds > 0
