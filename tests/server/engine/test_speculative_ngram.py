"""Speculative decoding by prompt lookup (ngram): the same tokens as the plain engine.

The tiny random model never copies its prompt, so half the rows carry a logit bias towards three of
their prompt's tokens: their outputs then repeat, drafts are proposed from the prompt and the output,
and the model's own logits still decide which of the three comes (so some drafts fail). Mixed batches of adapter and base rows with repetitive prompts (so drafts hit), greedy and seeded
sampling (penalties, min_tokens and logprobs included), through preemption and prefix-cache hits,
and stops inside an accepted run; drafts must actually be accepted.
"""
from __future__ import annotations

import random

import pytest

from server.cli import build_parser
from server.config import ConfigError, ServerConfig
from server.engine import LLM, SamplingParams
from server.engine.speculative_config import parse_speculative_config
from tests.server.engine.test_engine_prefix_cache import check_blocks

pytestmark = pytest.mark.unit

VOCAB = 512
# disable_by_batch_size past the batches here: every step speculates, so exactness is checked in full batches.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": 64}


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 9))]
        prompts.append([rng.randrange(3, VOCAB) for _ in range(3)] + motif * rng.randint(3, 5))
    return prompts


def looping(prompt: list[int]) -> dict[int, float]:
    """A logit bias that keeps the output among three of the prompt's tokens (see the module's docstring)."""
    return {t: 10.0 for t in prompt[-3:]}


def pair(model_dir, adapters, **kw) -> tuple[LLM, LLM]:
    opts = dict(device="cpu", dtype="float32", max_loras=4, max_model_len=256, max_num_batched_tokens=64,
                block_size=16, kernels="torch", **kw)
    llms = LLM(model_dir, **opts), LLM(model_dir, speculative_config=SPEC, **opts)
    for llm in llms:
        llm.add_adapter("r8_all", adapters["r8_all"])
        llm.add_adapter("r4_qv", adapters["r4_qv"])
    return llms


def assert_same(plain, spec) -> None:
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        assert (b.finish_reason, b.text) == (a.finish_reason, a.text)
        if a.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-5


def mixed_params(i: int, sampled: bool, bias: dict[int, float]) -> SamplingParams:
    """Row i of a mixed batch: logprobs, penalties or min_tokens by turns, `bias` on two rows in three;
    greedy, or seeded sampling."""
    extra = [{}, {"logprobs": 2}, {"presence_penalty": 0.5, "repetition_penalty": 1.2}, {"min_tokens": 6}][i % 4]
    if i % 3:
        extra = {**extra, "logit_bias": bias}
    if sampled:
        extra = {**extra, "temperature": 0.8, "top_p": 0.95, "seed": 100 + i}
    return SamplingParams(max_tokens=40, ignore_eos=True, **{"temperature": 0.0, **extra})


def generate_checked(llm: LLM, prompts, params, names) -> list:
    """llm.generate, with the block pool's invariants checked after every step."""
    engine = llm.engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p, name in zip(ids, prompts, params, names):
        engine.add_request(rid, prompt, p, llm._versions[name] if name else None)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        check_blocks(engine)
    return [final[r] for r in ids]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_mixed_batch_matches_plain_engine_through_preemption_and_prefix_hits(tiny_model_dir, tiny_adapters, sampled):
    plain, spec = pair(tiny_model_dir, tiny_adapters, kv_cache_blocks=20)
    prompts = repetitive_prompts(8, seed=3)
    prompts += [p[:] for p in prompts[:2]]  # the same prompts again: prefix-cache hits
    names = [None, "r8_all", "r4_qv", None, "r8_all", "r4_qv", None, "r8_all", None, "r8_all"]

    ps = [mixed_params(i, sampled, looping(prompts[i])) for i in range(len(prompts))]
    outs = [generate_checked(llm, prompts, ps, names) for llm in (plain, spec)]
    assert_same(*outs)
    stats = spec.engine.stats()
    assert stats.scheduler.preemptions > 0 and stats.prefix_cache.hit_tokens > 0
    processor = spec.engine.output_processor
    assert processor.num_accepted_tokens > 0, "no draft was accepted: the test shows nothing"
    assert processor.num_draft_tokens >= processor.num_accepted_tokens


def test_stops_inside_an_accepted_run_cut_where_the_plain_engine_stops(tiny_model_dir, tiny_adapters):
    plain, spec = pair(tiny_model_dir, tiny_adapters, kv_cache_blocks=128)
    prompts = repetitive_prompts(4, seed=5)
    free = plain.generate(prompts, [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logit_bias=looping(p))
                                    for p in prompts], adapters=[None, "r8_all"] * 2)
    # Stop on a token and on a text the free run reaches after a few tokens, and at odd max_tokens.
    ps = []
    for prompt, out in zip(prompts, free):
        bias = looping(prompt)
        ps.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logit_bias=bias, stop_token_ids=[out.token_ids[9]]))
        ps.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logit_bias=bias,
                                 stop=[out.text[len(out.text) // 2:][:3]]))
        ps.append(SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logit_bias=bias))
    repeated = [p for p in prompts for _ in range(3)]
    names = [n for n in [None, "r8_all"] * 2 for _ in range(3)]
    outs = [llm.generate(repeated, ps, adapters=names) for llm in (plain, spec)]
    assert_same(*outs)
    assert spec.engine.output_processor.num_accepted_tokens > 0


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "speculative method 'eagle' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "speculative config key 'model' is not supported"),
    ('{"method": "ngram"}', "speculative config needs num_speculative_tokens"),
    ("not json", "speculative config is not JSON"),
])
def test_other_methods_and_keys_are_refused_in_one_line(value, message):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(value)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_vllm_defaults():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}')
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (2, 2, 2)


def test_the_serve_flag_is_parsed_and_refuses_other_methods_in_one_line(tmp_path):
    def config(value: str) -> ServerConfig:
        args = build_parser().parse_args(["serve", "--model", "demo", "--data-dir", str(tmp_path),
                                          "--admin-token", "x" * 16, "--speculative-config", value])
        return ServerConfig.from_args(args, env={})

    assert config('{"method": "ngram", "num_speculative_tokens": 2}').engine.speculative_config is not None
    with pytest.raises(ConfigError) as e:
        config('{"method": "eagle", "num_speculative_tokens": 2}')
    assert str(e.value) == "--speculative-config: speculative method 'eagle' is not supported; supported: ngram, medusa, draft_model"
