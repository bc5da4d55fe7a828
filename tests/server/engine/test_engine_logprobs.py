"""Logprobs and prompt logprobs equal log_softmax of transformers + peft logits (float32, 1e-4),
for mixed batches of adapters of different ranks and base rows, across prefill chunks,
preemption and forks."""
from __future__ import annotations

import pytest
import torch

from server.engine import LLM, SamplingParams
from tests.engine_helpers import drive, random_prompts

pytestmark = pytest.mark.unit

VOCAB = 512
TOL = 1e-4
ADAPTERS = ("r4_qv", "r8_all", "r16_rslora")  # ranks 4, 8, 16


def make_llm(model_dir, adapters, **kw) -> LLM:
    opts = dict(device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=128, max_model_len=256,
                max_num_batched_tokens=32, block_size=16)
    llm = LLM(model_dir, **{**opts, **kw})
    for name in ADAPTERS:
        llm.add_adapter(name, adapters[name])
    return llm


def assert_entry(entry, token: int, row: torch.Tensor, k: int) -> None:
    """One TokenLogprobs against the reference log-distribution `row` [V]."""
    assert entry.token_id == token
    assert abs(entry.logprob - float(row[token])) <= TOL, (entry.logprob, float(row[token]))
    assert len(entry.top) == k
    ref_top = row.topk(k).values.tolist() if k else []
    values = [v for _, v in entry.top]
    assert values == sorted(values, reverse=True)
    assert all(abs(a - b) <= TOL for a, b in zip(values, ref_top)), (values, ref_top)
    # Ids checked through their values: near-ties may order differently, but every id named
    # must carry its own logprob.
    assert all(abs(v - float(row[t])) <= TOL for t, v in entry.top)


def assert_matches(out, prompt: list[int], params: SamplingParams, ref: torch.Tensor) -> None:
    """`ref` = hf log_softmax over prompt + out.token_ids."""
    p = len(prompt)
    if params.logprobs is None:
        assert out.logprobs is None
    else:
        assert len(out.logprobs) == len(out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert_entry(entry, token, ref[p - 1 + i], params.logprobs)
            if params.greedy:
                assert token == int(ref[p - 1 + i].argmax())
    if params.prompt_logprobs is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == p and out.prompt_logprobs[0] is None
        for j in range(1, p):
            assert_entry(out.prompt_logprobs[j], prompt[j], ref[j - 1], params.prompt_logprobs)


def test_logprobs_and_prompt_logprobs_match_peft(tiny_model_dir, tiny_adapters, hf_logprobs):
    llm = make_llm(tiny_model_dir, tiny_adapters)
    prompts = random_prompts(7, (4, 20), VOCAB, seed=61)
    prompts[2] = random_prompts(1, (90, 90), VOCAB, seed=62)[0]  # 90 > the 32-token budget: 3 chunks
    names = ["r4_qv", None, "r8_all", "r16_rslora", None, "r8_all", "r4_qv"]
    greedy = dict(temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=6, logprobs=5, prompt_logprobs=5, **greedy),
        SamplingParams(max_tokens=6, logprobs=5, prompt_logprobs=2, **greedy),
        SamplingParams(max_tokens=5, logprobs=3, prompt_logprobs=5, **greedy),
        SamplingParams(max_tokens=0, prompt_logprobs=4),  # score the prompt only
        SamplingParams(max_tokens=6, logprobs=0, **greedy),  # the token's own logprob, no alternatives
        SamplingParams(max_tokens=4, prompt_logprobs=0, **greedy),
        # Sampled, and modified every way: logprobs stay those of the model itself.
        SamplingParams(max_tokens=6, temperature=0.7, seed=5, logprobs=5, ignore_eos=True, presence_penalty=1.5,
                       repetition_penalty=1.3, logit_bias={5: 4.0, 9: -3.0}, min_p=0.01),
    ]
    outs = llm.generate(prompts, params, adapters=names)
    for prompt, name, p, out in zip(prompts, names, params, outs):
        assert out.finish_reason == "length"
        assert len(out.token_ids) == p.max_tokens
        assert_matches(out, prompt, p, hf_logprobs(name, prompt + out.token_ids))
    assert outs[3].token_ids == [] and outs[3].text == ""
    assert llm.engine.stats().kv_blocks.used == 0


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny_model_dir, tiny_adapters, hf_logprobs):
    # 12 blocks of 16 tokens for 6 prompts of 60-80 tokens prefilled 32 tokens a step: sequences are
    # preempted with their prompt half computed and resume, each prompt entry made exactly once.
    llm = make_llm(tiny_model_dir, tiny_adapters, kv_cache_blocks=12, max_model_len=128)
    prompts = random_prompts(6, (60, 80), VOCAB, seed=63)
    names = [None, "r8_all", "r16_rslora", "r4_qv", None, "r8_all"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    scheduler = llm.engine.scheduler
    preempt = scheduler._preempt
    mid_prefill: list[int] = []

    def recording(seq, batch):
        if 0 < seq.num_computed_tokens < seq.num_prompt_tokens:
            mid_prefill.append(seq.num_computed_tokens)
        preempt(seq, batch)

    scheduler._preempt = recording
    outs = llm.generate(prompts, params, adapters=names)
    assert mid_prefill
    for prompt, name, out in zip(prompts, names, outs):
        assert_matches(out, prompt, params, hf_logprobs(name, prompt + out.token_ids))
    assert llm.engine.stats().kv_blocks.used == 0


def test_forked_choices_logprobs_match_peft(tiny_model_dir, tiny_adapters, hf_logprobs):
    # Each of n seeded choices reads the shared prompt blocks and its own private copy of the
    # partly filled last one: its logprobs are those of peft on its own tokens.
    llm = make_llm(tiny_model_dir, tiny_adapters)
    prompt = random_prompts(1, (70, 70), VOCAB, seed=64)[0]  # 4 full blocks of 16 and a partial one
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    out = llm.generate([prompt], params, adapters=["r16_rslora"])[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    for choice in out.outputs:
        assert choice.prompt_logprobs is out.prompt_logprobs
        assert_matches(choice, prompt, params, hf_logprobs("r16_rslora", prompt + choice.token_ids))


def test_only_requests_that_ask_compute_prompt_logits(tiny_model_dir, tiny_adapters):
    llm = make_llm(tiny_model_dir, tiny_adapters, max_num_batched_tokens=256)
    model = llm.engine.runner.model
    forward = model.forward
    rows: list[int] = []

    def counting(input_ids, kv, ctx, logits_indices):
        rows.append(logits_indices.numel())
        return forward(input_ids, kv, ctx, logits_indices)

    model.forward = counting
    prompts = random_prompts(3, (30, 30), VOCAB, seed=65)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, plain)
    assert rows == [3, 3]  # the last token of each sequence only
    rows.clear()
    llm.generate(prompts, [plain, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1), plain])
    assert rows == [3 + 29, 3]


def test_prompt_logprobs_through_fair_step_chunks_equal_unchunked(tiny_model_dir, tiny_adapters, hf_logprobs):
    """A scored prompt arriving while another tenant decodes is prefilled in chunks the cap's cost allows
    (each prompt-logprob position costs its logits row too, so the chunks are shorter than the cap);
    its prompt logprobs equal PEFT's and those of the same prompt prefilled in one step."""
    prompt = random_prompts(1, (150, 150), VOCAB, seed=64)[0]
    short = random_prompts(1, (6, 6), VOCAB, seed=65)[0]
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=5)
    outs = {}
    chunks: list[int] = []
    for cap in (16, None):
        llm = make_llm(tiny_model_dir, tiny_adapters, max_num_batched_tokens=256, max_prefill_tokens_while_decoding=cap)
        engine = llm.engine
        engine.add_request("victim", short, SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True),
                           tenant="victim")
        engine.step()
        schedule = engine.scheduler.schedule

        def recording_schedule():
            batch = schedule()
            chunks.extend(n for s, n in zip(batch.seqs, batch.num_tokens) if cap and s.tenant == "scorer")
            return batch

        engine.scheduler.schedule = recording_schedule
        engine.add_request("scored", prompt, scored, llm._versions["r8_all"], tenant="scorer")
        outs[cap] = drive(engine)["scored"]
    assert sum(chunks) == 150 + 1 and chunks[-1] == 1  # the prompt, then one decode step
    assert max(chunks) < 16 and len(chunks) > 150 // 16 + 1
    assert_matches(outs[16], prompt, scored, hf_logprobs("r8_all", prompt + outs[16].token_ids))
    assert_same_prompt_logprobs(outs[16], outs[None])


def assert_same_prompt_logprobs(chunked_out, whole_out) -> None:
    assert chunked_out.token_ids == whole_out.token_ids
    for chunked, whole in zip(chunked_out.prompt_logprobs[1:], whole_out.prompt_logprobs[1:]):
        assert chunked.token_id == whole.token_id and abs(chunked.logprob - whole.logprob) <= TOL
        assert all(abs(a - b) <= TOL for (_, a), (_, b) in zip(chunked.top, whole.top))


def test_prompt_logprobs_through_latency_sized_chunks_equal_unchunked(tiny_model_dir, tiny_adapters):
    """Under the latency-aware cap (auto on a CPU) chunk sizes follow measured step times, so they differ
    run to run; the outputs never do."""
    prompt = random_prompts(1, (150, 150), VOCAB, seed=66)[0]
    short = random_prompts(1, (6, 6), VOCAB, seed=67)[0]
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=5)
    outs = {}
    for ratio in (1.25, None):
        llm = make_llm(tiny_model_dir, tiny_adapters, max_num_batched_tokens=256,
                       max_prefill_tokens_while_decoding=64 if ratio else None, max_prefill_step_ratio=ratio)
        engine = llm.engine
        engine.add_request("victim", short, SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True),
                           tenant="victim")
        for _ in range(4):
            engine.step()
        engine.add_request("scored", prompt, scored, llm._versions["r8_all"], tenant="scorer")
        outs[ratio] = drive(engine)["scored"]
        if ratio:
            assert engine.scheduler.latency.decode_seconds is not None  # the engine timed its steps
    assert_same_prompt_logprobs(outs[1.25], outs[None])
