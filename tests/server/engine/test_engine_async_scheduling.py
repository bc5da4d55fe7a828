"""Async scheduling (issue 21, item 5; server.engine.async_step): step N+1 is scheduled and prepared while
step N runs on a worker thread. Checked on the CPU against the synchronous engine, step by step (every
step()'s outputs the same: tokens, text, finish reasons, aborts, no extra token), and against
transformers + peft; the worker's only host reads are the sampler's."""
from __future__ import annotations

import random
import threading

import pytest
import torch

import server.engine.model_runner as model_runner
from server.engine import LLM, SamplingParams
from server.engine.async_step import overlappable
from server.engine.output_text import OutputTexts
from tests.engine_helpers import random_prompts

VOCAB = 512
TOL = 1e-4
ADAPTERS = ("r4_qv", "r8_all", "r16_rslora")


def make_llm(model_dir, adapters, async_scheduling: bool, padded: bool = False, **kw) -> LLM:
    opts = dict(device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=64, max_model_len=128,
                max_num_batched_tokens=256, max_num_seqs=8, block_size=16, max_lora_rank=16)
    llm = LLM(model_dir, async_scheduling=async_scheduling, **{**opts, **kw})
    for name in ADAPTERS:
        llm.add_adapter(name, adapters[name])
    if padded:
        cfg = llm.engine.config
        llm.engine.runner.use_padded_decode(cfg.lora.max_loras, cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len)
    return llm


def trace(llm: LLM, requests, aborts: dict[int, list[str]] | None = None, max_steps: int = 500) -> list[list]:
    """Every step()'s outputs as (request, choice, tokens, text, finished, reason, logprobs): requests are
    (id, prompt, params, adapter name) added up front; aborts: step number -> request ids aborted
    before it."""
    engine = llm.engine
    texts = OutputTexts(engine.detokenizer, engine.abort_choice)  # the front end, as the LLM API's
    for rid, prompt, params, name in requests:
        engine.add_request(rid, prompt, params, llm._versions[name] if name else None)
        texts.add(rid, params)
    steps = []
    for k in range(max_steps):
        for rid in (aborts or {}).get(k, ()):
            engine.abort_request(rid)
        if not engine.has_unfinished_requests():
            return steps
        outs = texts.apply(engine.step())
        if outs:  # a step that only reported a stop string's abort (dropped by the front end) says nothing
            steps.append([(o.request_id, o.index, o.token_ids, o.text, o.finished, o.finish_reason,
                           [(e.token_id, e.logprob) for e in o.logprobs or ()]) for o in outs])
    raise AssertionError("the engine did not finish")


def assert_same_trace(got: list[list], want: list[list]) -> None:
    """Step for step the same outputs; logprobs equal to within TOL (the async steps' batches carry the
    rows of sequences that just ended, which may change float rounding, never a token). The async engine
    may take one more step at the end, with no output: the one scheduled ahead for rows that all ended."""
    if len(got) == len(want) + 1 and got[-1] == []:
        got = got[:-1]
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert [o[:6] for o in a] == [o[:6] for o in b], f"step {k}"
        for x, y in zip(a, b):
            assert [t for t, _ in x[6]] == [t for t, _ in y[6]]
            assert all(abs(p - q) <= TOL for (_, p), (_, q) in zip(x[6], y[6]))


def mixed_requests(seed: int, max_tokens=(3, 9, 5, 12, 7, 1), **params) -> list:
    names = ["r8_all", None, "r4_qv", "r16_rslora", "r8_all", None]
    prompts = random_prompts(len(names), (4, 30), VOCAB, seed=seed)
    return [(f"q{i}", prompt, SamplingParams(max_tokens=m, **{"temperature": 0.0, "ignore_eos": True,
                                                                "logprobs": 2, **params}), name)
            for i, (prompt, name, m) in enumerate(zip(prompts, names, max_tokens))]


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_async_steps_match_the_synchronous_engine_and_peft(tiny_model_dir, tiny_adapters, peft_oracle, padded):
    # Adapters of three ranks and base rows in one batch, finishing at six different steps.
    requests = mixed_requests(seed=3)
    sync = make_llm(tiny_model_dir, tiny_adapters, False, padded)
    fast = make_llm(tiny_model_dir, tiny_adapters, True, padded)
    want = trace(sync, requests)
    got = trace(fast, requests)
    assert_same_trace(got, want)
    stats = fast.engine.overlap.stats()
    assert stats.launched >= 10 and stats.ahead >= 8  # most decode steps were scheduled ahead
    final = {o[0]: o for step in got for o in step if o[4]}
    for rid, prompt, params, name in requests:
        tokens = final[rid][2]
        assert tokens == peft_oracle(tiny_model_dir, tiny_adapters[name] if name else None, prompt,
                                     params.max_tokens)
        assert final[rid][5] == "length"
    engine = fast.engine
    assert engine.stats().kv_blocks.used == 0 and all(c == 0 for c in engine.blocks.ref_counts)
    assert not engine.has_unfinished_requests() and not engine.overlap.in_flight


def test_stop_tokens_eos_and_stop_strings_end_requests_without_an_extra_token(tiny_model_dir, tiny_adapters):
    # Each request stops at a token the synchronous engine emits mid-stream: a stop token id, EOS (a
    # stop id the model emits, taken as its eos), or a stop string cut from its text. The async engine
    # scheduled the next step before it knew; that step's row for the request must vanish.
    probe = make_llm(tiny_model_dir, tiny_adapters, False)
    plain = trace(probe, mixed_requests(seed=4, max_tokens=(10,) * 6))
    finals = {o[0]: o for step in plain for o in step if o[4]}
    requests = []
    for i, (rid, prompt, params, name) in enumerate(mixed_requests(seed=4, max_tokens=(10,) * 6)):
        tokens, text = finals[rid][2], finals[rid][3]
        middle = len(text) // 2
        if i % 3 == 0:  # a stop token mid-stream (EOS ends a request the same way)
            params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[3]])
        elif i % 3 == 1:  # a stop string: found in the detokenized text
            params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                    stop=[text[middle : middle + 3]])
        else:  # the very first token stops it: the prefill step ends it
            params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[0]])
        requests.append((rid, prompt, params, name))
    sync = make_llm(tiny_model_dir, tiny_adapters, False)
    want = trace(sync, requests)
    fast = make_llm(tiny_model_dir, tiny_adapters, True)
    got = trace(fast, requests)
    assert_same_trace(got, want)
    # Fair share charged the same output tokens: a discarded row's token is never charged.
    assert fast.engine.scheduler.waiting.counters == sync.engine.scheduler.waiting.counters != {}
    reasons = [o[5] for step in got for o in step if o[4]]
    assert reasons.count("stop") == 6
    stats = fast.engine.overlap.stats()
    assert stats.ahead > 0 and stats.discarded >= 4  # rows run for requests already stopped, never streamed
    for step in got:  # every streamed output is a prefix of its request's last one: nothing withdrawn
        for o in step:
            final = next(p for s in got for p in s if p[0] == o[0] and p[4])
            assert final[2][: len(o[2])] == o[2]


def test_aborts_mid_stream_and_a_seeded_sampled_row(tiny_model_dir, tiny_adapters):
    # Aborts land while a step is in flight (and one scheduled ahead holds the aborted rows); a seeded
    # sampled row draws from its own stream, so it too gives the synchronous engine's tokens.
    requests = mixed_requests(seed=5, max_tokens=(12,) * 6)
    rid, prompt, _, name = requests[2]
    requests[2] = (rid, prompt, SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7), name)
    aborts = {3: ["q0", "q4"], 6: ["q1"], 7: ["q5"]}
    sync = make_llm(tiny_model_dir, tiny_adapters, False)
    want = trace(sync, requests, aborts)
    fast = make_llm(tiny_model_dir, tiny_adapters, True)
    got = trace(fast, requests, aborts)
    assert_same_trace(got, want)
    assert fast.engine.scheduler.waiting.counters == sync.engine.scheduler.waiting.counters != {}
    aborted = {o[0]: o for step in got for o in step if o[5] == "abort"}
    assert set(aborted) == {"q0", "q4", "q1", "q5"}
    for step in got:  # nothing more after the abort
        assert all(o[2] == aborted[o[0]][2] for o in step if o[0] in aborted and o[4])
    stats = fast.engine.overlap.stats()
    assert stats.ahead > 0 and stats.discarded >= 3  # aborted while their step, or the next, was in flight
    assert fast.engine.stats().kv_blocks.used == 0


def test_preemption_and_admissions_fall_back_to_synchronous_steps(tiny_model_dir, tiny_adapters, peft_oracle):
    # 8 requests of up to 30 + 24 tokens cannot all hold their blocks in 14: preemption by recompute; 4
    # running seats, so the rest wait for admission.
    names = [None, "r8_all", "r16_rslora", "r4_qv"] * 2
    prompts = random_prompts(8, (20, 30), VOCAB, seed=12)
    requests = [(f"p{i}", p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), n)
                for i, (p, n) in enumerate(zip(prompts, names))]
    kw = dict(kv_cache_blocks=14, max_num_seqs=4)
    sync = make_llm(tiny_model_dir, tiny_adapters, False, **kw)
    want = trace(sync, requests)
    fast = make_llm(tiny_model_dir, tiny_adapters, True, **kw)
    got = trace(fast, requests)
    assert_same_trace(got, want)
    assert fast.engine.stats().scheduler.preemptions == sync.engine.stats().scheduler.preemptions > 0
    assert fast.engine.overlap.stats().ahead > 0
    final = {o[0]: o[2] for step in got for o in step if o[4]}
    for (rid, prompt, _, name) in requests[:4]:
        assert final[rid] == peft_oracle(tiny_model_dir, tiny_adapters[name] if name else None, prompt, 24)
    assert fast.engine.blocks.num_free_blocks == 14


def test_rows_that_need_their_tokens_on_the_host_run_synchronously(tiny_model_dir, tiny_adapters):
    # Penalties read the row's own tokens, min_tokens masks by count, n > 1 forks after the prompt: none
    # of these steps overlaps, and each gives the synchronous engine's outputs.
    prompts = random_prompts(3, (5, 15), VOCAB, seed=9)
    requests = [("pen", prompts[0], SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3,
                                                   presence_penalty=0.5), "r8_all"),
                ("min", prompts[1], SamplingParams(max_tokens=6, temperature=0.0, min_tokens=4), None),
                ("fork", prompts[2], SamplingParams(max_tokens=6, temperature=0.0, n=2, seed=1), "r4_qv")]
    fast = make_llm(tiny_model_dir, tiny_adapters, True)
    assert_same_trace(trace(fast, requests), trace(make_llm(tiny_model_dir, tiny_adapters, False), requests))
    assert fast.engine.overlap.stats().launched == 0


def test_overlappable_steps(tiny_model_dir, tiny_adapters):
    llm = make_llm(tiny_model_dir, tiny_adapters, False)
    engine = llm.engine
    prompts = random_prompts(2, (5, 10), VOCAB, seed=1)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=5, temperature=0.0), None)
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=5, temperature=0.0, frequency_penalty=0.5), None)
    prefill = engine.scheduler.schedule()
    assert not overlappable(prefill)  # a prefill step
    engine.output_processor.postprocess(prefill, engine.runner.run(prefill))
    decode = engine.scheduler.schedule()
    assert not overlappable(decode)  # the penalty row
    engine.output_processor.postprocess(decode, engine.runner.run(decode))
    engine.abort_request("b")
    engine.step()
    assert overlappable(engine.scheduler.schedule())


def test_the_overlapped_step_reads_back_only_the_sampled_tokens(tiny_model_dir, tiny_adapters, monkeypatch):
    # The padded decode path (CUDA graphs on a GPU): on the worker, the forward, the input ids filled in
    # from the step before and the staging read nothing back from the device; the sampler does.
    llm = make_llm(tiny_model_dir, tiny_adapters, True, padded=True)
    requests = mixed_requests(seed=6, max_tokens=(8,) * 6)
    inside = threading.local()
    reads = {"sampler": 0, "elsewhere": []}
    real_sample = model_runner.sample_rows

    def sample(*args, **kwargs):
        inside.sampler = True
        try:
            return real_sample(*args, **kwargs)
        finally:
            inside.sampler = False

    def counted(name, real):
        def read(*args, **kwargs):
            if threading.current_thread().name.startswith("loraplex-step"):
                if getattr(inside, "sampler", False):
                    reads["sampler"] += 1
                else:
                    reads["elsewhere"].append(name)
            return real(*args, **kwargs)
        return read

    monkeypatch.setattr(model_runner, "sample_rows", sample)
    for name in ("item", "tolist", "nonzero", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counted(f"Tensor.{name}", getattr(torch.Tensor, name)))
    for name in ("nonzero", "unique", "unique_consecutive", "masked_select", "repeat_interleave"):
        monkeypatch.setattr(torch, name, counted(f"torch.{name}", getattr(torch, name)))
    trace(llm, requests)
    monkeypatch.undo()
    stats = llm.engine.overlap.stats()
    assert stats.ahead >= 5 and llm.engine.runner.padded.eager_steps >= stats.launched
    assert reads["elsewhere"] == [] and reads["sampler"] >= stats.launched


def test_async_scheduling_flag_reaches_the_engine(tmp_path):
    from server.cli import build_parser
    from server.config import ServerConfig
    from server.engine.config import EngineConfig

    parser = build_parser()
    assert parser.parse_args(["serve"]).async_scheduling is False
    args = parser.parse_args(["serve", "--data-dir", str(tmp_path), "--admin-token", "x" * 16,
                              "--async-scheduling"])
    assert ServerConfig.from_args(args, env={}).engine.scheduler.async_scheduling is True
    with pytest.raises(ValueError, match="async_scheduling must be true or false"):
        EngineConfig.of(model="m", async_scheduling="yes")


@pytest.mark.parametrize("seed", range(1, 9))
def test_random_workloads_match_the_synchronous_engine(tiny_model_dir, tiny_adapters, seed):
    # Admissions into a few seats, a pool small enough to preempt, stop ids that end requests at any step,
    # lengths from 1 token up, a penalty row now and then, and aborts at random steps.
    rng = random.Random(seed)
    count = rng.randint(6, 10)
    prompts = random_prompts(count, (3, 40), VOCAB, seed=100 + seed)
    requests = []
    for i, prompt in enumerate(prompts):
        extra = {"repetition_penalty": 1.2} if rng.random() < 0.15 else {}
        params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True, logprobs=1,
                                stop_token_ids=rng.sample(range(VOCAB), 40), **extra)
        requests.append((f"w{i}", prompt, params, rng.choice([*ADAPTERS, None])))
    aborts: dict[int, list[str]] = {}
    for rid, *_ in rng.sample(requests, 2):
        aborts.setdefault(rng.randint(1, 12), []).append(rid)
    kw = dict(kv_cache_blocks=rng.choice([6, 8, 64]), max_num_seqs=rng.choice([3, 4, 8]), max_model_len=96)
    sync = make_llm(tiny_model_dir, tiny_adapters, False, **kw)
    fast = make_llm(tiny_model_dir, tiny_adapters, True, **kw)
    assert_same_trace(trace(fast, requests, aborts), trace(sync, requests, aborts))
    assert fast.engine.stats().scheduler.preemptions == sync.engine.stats().scheduler.preemptions
    assert fast.engine.scheduler.waiting.counters == sync.engine.scheduler.waiting.counters
    assert fast.engine.blocks.num_free_blocks == kw["kv_cache_blocks"]
