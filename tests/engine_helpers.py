"""Shared bits of the engine tests: deterministic prompts and the PEFT comparison."""
from __future__ import annotations

import random

from server.engine import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids 3.. skip the special tokens (bos/eos/pad) so prompts look like text.
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def assert_matches_peft(llm: LLM, model_dir, adapter_dirs, prompts, names, outs, max_tokens, peft_oracle):
    """Every output equals what transformers + peft generate for that request alone."""
    assert len(outs) == len(prompts) == len(names)
    for prompt, name, out in zip(prompts, names, outs):
        expected = peft_oracle(model_dir, adapter_dirs[name] if name else None, prompt, max_tokens)
        assert out.token_ids == expected, f"adapter {name}: engine {out.token_ids} != peft {expected}"
        assert out.finish_reason == "length"


def drive(engine, check=None, max_steps: int = 100_000) -> dict:
    """Step `engine` until idle; finished outputs by request id, in finishing order.

    `check(engine)` runs after every step, for invariants that must hold throughout.
    """
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if check is not None:
            check(engine)
    raise AssertionError("engine did not finish")


def generate_in_one_batch(llm: LLM, prompts, names, params: SamplingParams) -> list:
    """Every request added before the first step, which must run them all together (adapters of every
    rank and base rows in one forward pass); the finished outputs in request order."""
    engine = llm.engine
    ids = [f"one-batch-{i}" for i in range(len(prompts))]
    for rid, prompt, name in zip(ids, prompts, names):
        engine.add_request(rid, prompt, params, llm._versions.get(name) if name else None)
    engine.step()
    assert engine.stats().scheduler.running == len(prompts)
    final = drive(engine)
    return [final[r] for r in ids]


def generate_through_preemption_and_prefix_hits(llm: LLM, vocab: int) -> tuple[list, list, list]:
    """8 greedy sequences of ~50 + 24 tokens over base rows and the adapters "r8_all" and "r4_qv" (added
    to `llm` already), sharing a 33-token prefix. With the KV pool at 18 blocks of 16, preemption is
    certain and the prefix is served from the cache to those that come after its first writer; both
    are asserted. Returns (prompts, adapter names, outputs)."""
    prefix = random_prompts(1, (33, 33), vocab, seed=6)[0]
    prompts = [prefix + p for p in random_prompts(8, (10, 20), vocab, seed=7)]
    names = [None, "r8_all", "r4_qv", None] * 2
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, logprobs=0, **GREEDY), adapters=names)
    stats = llm.engine.stats()
    assert stats.scheduler.preemptions > 0 and stats.prefix_cache.hit_tokens > 0
    return prompts, names, outs


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **GREEDY)
