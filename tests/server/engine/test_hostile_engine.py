"""The engine never dies of a request: hostile sampling values, broken adapters and poisoned KV blocks.

A request can fail, alone, with finish_reason "error"; it can never take the
engine loop, or its batch neighbours' tokens, down with it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from adapters.format import LoraAdapter, LoraWeights, load_adapter_dir
from kernels import attention_ref, attention_triton
from kernels.metadata import AttentionBatch
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.async_engine import AsyncEngine
from server.engine.output_text import OutputTexts
from server.engine.protocol import EngineDeadError, EngineRequest
from server.engine.sampler import SamplingRow, sample_rows
from tests.engine_helpers import drive, greedy, random_prompts

pytestmark = pytest.mark.unit

VOCAB = 512


def make_engine(model_dir, **kw) -> LLMEngine:
    cfg = dict(model=str(model_dir), device="cpu", max_loras=4, kv_cache_blocks=64, max_model_len=256)
    return LLMEngine(EngineConfig.of(**{**cfg, **kw}))


def broken(adapter: LoraAdapter, a_value: float | None = None, scaling: float | None = None) -> LoraAdapter:
    """`adapter` with every A matrix set to `a_value` and/or every scaling to `scaling`."""
    weights = {
        key: LoraWeights(torch.full_like(w.a, a_value) if a_value is not None else w.a, w.b,
                         scaling if scaling is not None else w.scaling)
        for key, w in adapter.weights.items()
    }
    return dataclasses.replace(adapter, weights=weights)


@pytest.fixture()
def engine(tiny_model_dir, tiny_adapters):
    engine = make_engine(tiny_model_dir)
    good = load_adapter_dir(tiny_adapters["r8_all"], engine.adapter_shape, 64)
    engine.add_adapter("good@1", good)
    engine.add_adapter("nan@1", broken(good, a_value=float("nan")))
    engine.add_adapter("inf@1", broken(good, a_value=float("inf")))
    engine.add_adapter("huge@1", broken(good, scaling=1e38))  # a lora_alpha no upload check let through
    return engine


def run(engine: LLMEngine, requests: dict[str, tuple]) -> dict:
    for rid, (prompt, params, adapter) in requests.items():
        engine.add_request(rid, prompt, params, adapter)
    return drive(engine, max_steps=2000)


# ---- sampling values the API accepts ----

def test_sampling_params_below_epsilon_are_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=5e-324).greedy
    assert SamplingParams(temperature=9.99e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy and not SamplingParams(temperature=0.7).greedy
    for bad in (float("nan"), float("inf"), -1e-320):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)


def test_tiny_and_denormal_top_p_and_temperature_give_the_top_token(engine):
    prompts = random_prompts(3, (4, 12), VOCAB, seed=41)
    plain = run(engine, {f"g{i}": (p, greedy(4), None) for i, p in enumerate(prompts)})
    expected = [plain[f"g{i}"].token_ids for i in range(len(prompts))]
    cases = [dict(top_p=p) for p in (1e-320, 1e-46, 5e-324, 1e-45, 1e-39, 1e-3)]
    cases += [dict(temperature=t) for t in (1e-40, 1e-320, 5e-324, 1e-30, 9.99e-6)]
    cases += [dict(temperature=1.5, top_k=50, top_p=1e-320), dict(temperature=1e-320, top_p=1e-320, top_k=1)]
    rng = random.Random(1234)  # a seeded sweep over the whole float range below the thresholds
    for _ in range(12):
        cases.append(dict(temperature=rng.uniform(0.05, 2.0), top_p=10 ** -rng.uniform(3, 323.9)))
        cases.append(dict(temperature=10 ** -rng.uniform(5.01, 323.9), top_p=rng.uniform(1e-9, 1.0)))
    requests = {}
    for n, case in enumerate(cases):
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=4, ignore_eos=True, seed=n, **{"temperature": 1.0, **case})
            requests[f"{n}-{i}"] = (prompt, params, None)
    final = run(engine, requests)
    for rid, out in final.items():
        n, i = map(int, rid.split("-"))
        assert out.finish_reason == "length", (cases[n], out.error)
        assert out.token_ids == expected[i], cases[n]


def test_sampler_survives_extreme_finite_logits():
    logits = torch.zeros(4, VOCAB)
    logits[:, 7] = 3e38  # top token
    logits[:, 8] = -3e38
    logits[2] = torch.full((VOCAB,), 1e-42)  # denormals: equal probabilities, but 9 is the top logit
    logits[2, 9] = 2e-42
    logits[3, 11] = 3.3e38
    params = [SamplingParams(temperature=t, top_p=p, top_k=k)
              for t, p, k in ((0.5, 1.0, 0), (1e-5, 1e-320, 0), (2.0, 1e-46, 3), (1.0, 1.0, 0))]
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows = [SamplingRow(p, 0, i) for i, p in enumerate(params)]
        assert sample_rows(logits, rows, gen).tokens[:3] == [7, 7, 9]


# ---- a broken adapter fails its own requests only ----

def test_non_finite_adapter_requests_fail_alone(engine, tiny_model_dir, tiny_adapters, peft_oracle):
    prompts = random_prompts(4, (3, 20), VOCAB, seed=42)
    good = {f"base{i}": (p, None) for i, p in enumerate(prompts[:2])}
    good.update({f"good{i}": (p, "good@1") for i, p in enumerate(prompts[2:])})
    dirs = {None: None, "good@1": tiny_adapters["r8_all"]}
    expected = {rid: peft_oracle(tiny_model_dir, dirs[a], p, 6) for rid, (p, a) in good.items()}
    sampled = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3)
    bad = {"nan-greedy": (prompts[0], greedy(6), "nan@1"), "nan-sampled": (prompts[1], sampled, "nan@1"),
           "inf": (prompts[2], greedy(6), "inf@1"), "huge": (prompts[3], sampled, "huge@1")}
    # The bad requests come first, so they hold block 0, the slot padded decode rows point at.
    final = run(engine, {**bad, **{rid: (p, greedy(6), a) for rid, (p, a) in good.items()}})
    for rid, (_, _, adapter) in bad.items():
        assert final[rid].finish_reason == "error", rid
        assert final[rid].error == f"adapter {adapter} produced non-finite logits"
        assert final[rid].token_ids == []
    for rid in good:
        assert final[rid].finish_reason == "length" and final[rid].token_ids == expected[rid], rid
    # The engine goes on serving, over the blocks and slots the bad requests used.
    again = run(engine, {rid + "-again": (p, greedy(6), a) for rid, (p, a) in good.items()})
    assert {rid: o.token_ids for rid, o in again.items()} == {rid + "-again": t for rid, t in expected.items()}
    assert engine.stats().kv_blocks.used == 0 and not engine.host.pins and not engine.lora_slots.users


def test_detokenizer_failure_fails_that_request_only(engine):
    """Text is the front end's (server.engine.output_text): a detokenizer bug on one request's text ends
    that request with finish_reason "error" before the token it failed on, and aborts it in the engine;
    the other requests' texts and tokens are untouched."""
    prompts = random_prompts(3, (5, 9), VOCAB, seed=43)
    clean = run(engine, {f"c{i}": (p, greedy(5), None) for i, p in enumerate(prompts)})
    inner = engine.detokenizer
    victim = []

    class Exploding:  # a detokenizer bug that hits one request's text only
        def new_state(self, start=0):
            state = inner.new_state(start)
            if not victim:
                victim.append(state)
            return state

        def step(self, state, ids):
            if state is victim[0] and len(ids) > 3:
                raise UnicodeError("broken byte sequence")
            return inner.step(state, ids)

        def flush(self, state, ids):
            return inner.flush(state, ids)

    texts = OutputTexts(Exploding(), engine.abort_choice)
    for i, p in enumerate([prompts[1], prompts[0], prompts[2]]):  # r1's choice is made first: the victim
        rid = f"r{(1, 0, 2)[i]}"
        texts.add(rid, greedy(5))
        engine.add_request(rid, p, greedy(5))
    final = {}
    for _ in range(200):
        for out in texts.apply(engine.step()):
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert final["r1"].finish_reason == "error" and "UnicodeError: broken byte sequence" in final["r1"].error
    assert final["r1"].token_ids == clean["c1"].token_ids[:3]
    assert final["r1"].text == inner_text(inner, clean["c1"].token_ids[:3])
    for rid, cid in (("r0", "c0"), ("r2", "c2")):
        assert final[rid].token_ids == clean[cid].token_ids
        assert final[rid].text == inner_text(inner, clean[cid].token_ids) and final[rid].finish_reason == "length"
    assert "r1" not in engine.seqs and engine.stats().kv_blocks.used == 0


def inner_text(detokenizer, ids: list[int]) -> str:
    state, seen, text = detokenizer.new_state(), [], ""
    for token in ids:
        seen.append(token)
        text += detokenizer.step(state, seen)
    return text + detokenizer.flush(state, seen)


# ---- freed KV blocks never leak into another sequence ----

def test_poisoned_free_blocks_do_not_reach_decodes(tiny_model_dir, peft_oracle):
    engine = make_engine(tiny_model_dir)
    run(engine, {"warm": ([5, 6, 7], greedy(2), None)})  # block 0 goes to the back of the free list
    for k_cache, v_cache in engine.runner.kv_caches:  # every block is free: whatever they hold is stale
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    prompts = random_prompts(4, (2, 40), VOCAB, seed=44)
    assert len({len(p) for p in prompts}) == 4  # decodes of different lengths: padded rows exist
    final = run(engine, {str(i): (p, greedy(8), None) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        assert final[str(i)].token_ids == peft_oracle(tiny_model_dir, None, prompt, 8), i


@pytest.mark.parametrize("impl", [attention_ref, attention_triton], ids=["ref", "triton"])
def test_masked_context_slots_never_contribute(impl):
    """Decodes of different lengths over a pool whose every unowned slot (block 0 included) is NaN."""
    block_size, hq, hkv, d = 16, 4, 2, 16
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs interpreted on CPU
    lens, tables = [20, 5, 40], [[3, 1], [2], [6, 4, 5]]
    g = torch.Generator().manual_seed(5)
    k_cache = torch.full((8, block_size, hkv, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    ks = [torch.randn(n, hkv, d, generator=g) for n in lens]
    vs = [torch.randn(n, hkv, d, generator=g) for n in lens]
    for table, k, v in zip(tables, ks, vs):
        for pos in range(k.shape[0]):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
    batch = AttentionBatch.build(tables, [n - 1 for n in lens], [1] * len(lens), block_size, device)
    q = torch.randn(len(lens), hq, d, generator=g)
    out = torch.full_like(q, float("nan"), device=device)
    impl.paged_attention(q.to(device), k_cache.to(device), v_cache.to(device), batch, d ** -0.5, out)
    out = out.cpu()
    for b, (k, v) in enumerate(zip(ks, vs)):
        dense = F.scaled_dot_product_attention(q[b, :, None], k.transpose(0, 1), v.transpose(0, 1),
                                               scale=d ** -0.5, enable_gqa=True)[:, 0]  # [Hq, D]
        torch.testing.assert_close(out[b], dense, atol=2e-5, rtol=2e-5)


# ---- the async loop ----

def test_async_engine_outlives_bad_requests_and_says_why_it_died(engine):
    async def scenario(loop_engine: AsyncEngine) -> None:
        async def final(rid, prompt, params, adapter=None):
            out = None
            ids = prompt if isinstance(prompt, list) else engine.tokenize(prompt)
            async for out in loop_engine.generate(EngineRequest(rid, ids, params, adapter)):
                pass
            return out

        bad = await final("bad", "Hello", SamplingParams(max_tokens=4, temperature=1.0), "nan@1")
        assert bad.finish_reason == "error" and "non-finite" in bad.error
        attack = await final("attack", "Hello", SamplingParams(max_tokens=4, top_p=1e-320))
        plain = await final("plain", "Hello", SamplingParams(max_tokens=4, temperature=0.0))
        assert attack.error is None and attack.token_ids == plain.token_ids  # top-1 is the greedy token
        ok = await final("ok", [5, 6, 7], greedy(3))
        assert ok.finish_reason == "length" and len(ok.token_ids) == 3
        assert loop_engine.is_healthy and loop_engine.error is None

        def break_forward(e: LLMEngine) -> None:  # a true bug in the forward pass: a mis-shaped weight
            e.model.layers[0].qkv.weight = torch.empty(0)

        await loop_engine.call(break_forward)
        with pytest.raises(EngineDeadError):
            await final("doomed", [5, 6, 7], greedy(3))
        assert not loop_engine.is_healthy
        assert loop_engine.error is not None and loop_engine.error.startswith("RuntimeError(")

    loop_engine = AsyncEngine(engine)
    loop_engine.start()
    try:
        asyncio.run(scenario(loop_engine))
    finally:
        loop_engine.shutdown()
