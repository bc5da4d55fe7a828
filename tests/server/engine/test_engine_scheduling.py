"""Paged KV, chunked prefill, preemption and adapter-slot pressure keep outputs equal to PEFT's."""
from __future__ import annotations

import pytest

from server.engine import LLM, SamplingParams
from tests.engine_helpers import assert_matches_peft, drive, greedy, random_prompts

VOCAB = 512


def run_all(llm: LLM, prompts, names, params) -> tuple[list, int]:
    """Drive the engine step by step; returns outputs in order and the peak running batch size."""
    engine = llm.engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, name in zip(ids, prompts, names):
        engine.add_request(rid, prompt, params, llm._versions[name] if name else None)
    peaks = [0]
    final = drive(engine, lambda e: peaks.append(e.stats().scheduler.running))
    return [final[r] for r in ids], max(peaks)


def test_long_prompts_chunked_prefill_and_block_spanning(tiny_model_dir, tiny_adapters, peft_oracle):
    # A 32-token budget forces prompts of up to 150 tokens through several prefill chunks,
    # and 16-token blocks make every sequence span many blocks.
    llm = LLM(tiny_model_dir, device="cpu", max_loras=4, kv_cache_blocks=128, max_model_len=256,
              max_num_batched_tokens=32, block_size=16)
    for name, path in tiny_adapters.items():
        llm.add_adapter(name, path)
    names = ["r8_all", None, "r32_pattern", "r4_qv"]
    prompts = random_prompts(4, (70, 150), VOCAB, seed=11)
    outs, _ = run_all(llm, prompts, names, greedy(10))
    assert_matches_peft(llm, tiny_model_dir, tiny_adapters, prompts, names, outs, 10, peft_oracle)
    assert llm.engine.stats().kv_blocks.used == 0


def test_preemption_by_recompute_gives_same_tokens(tiny_model_dir, tiny_adapters, peft_oracle):
    # 8 sequences of up to 30 + 24 tokens need ~4 blocks of 16 each; 14 blocks cannot hold them all.
    llm = LLM(tiny_model_dir, device="cpu", max_loras=4, kv_cache_blocks=14, max_model_len=128, block_size=16)
    for name, path in tiny_adapters.items():
        llm.add_adapter(name, path)
    names = [None, "r8_all", "r16_rslora", "r4_qv"] * 2
    prompts = random_prompts(8, (20, 30), VOCAB, seed=12)
    outs, _ = run_all(llm, prompts, names, greedy(24))
    stats = llm.engine.stats()
    assert stats.scheduler.preemptions > 0
    assert_matches_peft(llm, tiny_model_dir, tiny_adapters, prompts, names, outs, 24, peft_oracle)
    assert stats.kv_blocks.used == 0
    assert llm.engine.blocks.num_free_blocks == 14
    assert all(c == 0 for c in llm.engine.blocks.ref_counts)


def test_more_adapters_than_slots_all_complete(tiny_model_dir, tiny_adapters, peft_oracle):
    llm = LLM(tiny_model_dir, device="cpu", max_loras=2, kv_cache_blocks=128, max_model_len=256)
    for name, path in tiny_adapters.items():
        llm.add_adapter(name, path)
    names = list(tiny_adapters) * 3 + [None, None]
    prompts = random_prompts(len(names), (5, 25), VOCAB, seed=13)
    engine = llm.engine
    ids = [f"s{i}" for i in range(len(names))]
    for rid, prompt, name in zip(ids, prompts, names):
        engine.add_request(rid, prompt, greedy(6), llm._versions[name] if name else None)
    def at_most_two_adapters(e) -> None:  # never more distinct adapters in a step than slots
        assert len({s.version_id for s in e.scheduler.running if s.version_id}) <= 2

    final = drive(engine, at_most_two_adapters)
    outs = [final[r] for r in ids]
    assert_matches_peft(llm, tiny_model_dir, tiny_adapters, prompts, names, outs, 6, peft_oracle)
    assert engine.stats().slots.loads >= 4
    assert engine.stats().slots.resident <= 2


def test_max_num_seqs_bounds_the_running_batch(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=128, max_model_len=256, max_num_seqs=3)
    prompts = random_prompts(7, (5, 10), VOCAB, seed=14)
    outs, peak = run_all(llm, prompts, [None] * 7, greedy(4))
    assert peak == 3
    assert all(len(o.token_ids) == 4 for o in outs)


def test_abort_frees_blocks(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=64, max_model_len=256)
    engine = llm.engine
    engine.add_request("a", random_prompts(1, (40, 40), VOCAB, 15)[0], SamplingParams(max_tokens=50))
    engine.add_request("b", random_prompts(1, (10, 10), VOCAB, 16)[0], SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.stats().kv_blocks.used > 0
    engine.abort_request("a")
    engine.abort_request("b")
    outs = engine.step()
    assert {o.request_id: o.finish_reason for o in outs} == {"a": "abort", "b": "abort"}
    assert engine.stats().kv_blocks.used == 0
    assert not engine.has_unfinished_requests()


def test_base_requests_pass_a_request_waiting_for_a_slot(tiny_model_dir, tiny_adapters):
    llm = LLM(tiny_model_dir, device="cpu", max_loras=1, kv_cache_blocks=64, max_model_len=256)
    llm.add_adapter("a", tiny_adapters["r8_all"])
    llm.add_adapter("b", tiny_adapters["r4_qv"])
    engine = llm.engine
    engine.add_request("holds-slot", [5, 6, 7], greedy(30), llm._versions["a"])
    engine.step()
    engine.add_request("needs-slot", [5, 6, 8], greedy(3), llm._versions["b"])  # the only slot is taken
    engine.add_request("base", [5, 6, 9], greedy(3))
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert running == {"holds-slot", "base"}  # base passed the blocked head; b waits for the slot
    final = drive(engine)
    assert set(final) == {"holds-slot", "needs-slot", "base"}


# ---- n choices: one prefill, shared blocks ----

def test_choices_share_the_prompt_blocks(tiny_model_dir, tiny_adapters):
    llm = LLM(tiny_model_dir, device="cpu", max_loras=2, kv_cache_blocks=64, max_model_len=256, block_size=16)
    llm.add_adapter("a", tiny_adapters["r8_all"])
    engine = llm.engine
    prompt = random_prompts(1, (70, 70), VOCAB, seed=17)[0]  # 4 full blocks and one partly filled
    alone = llm.generate([prompt], greedy(8), adapters="a")[0].token_ids
    engine.add_request("n3", prompt, SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True),
                       llm._versions["a"])
    used, shared = [], []

    def watch(e) -> None:
        used.append(e.blocks.num_used_blocks)
        shared.append(max(e.blocks.ref_counts))

    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        watch(engine)
    # Prefilled once (5 blocks held 3 times), then the partly filled last block is copied for
    # two of the three choices before they write to it: 7 blocks, where 3 copies would take 15.
    assert shared[0] == 3 and used[0] == 5
    assert max(used) == 7
    finals = {o.index: o for o in outputs if o.finished}
    assert sorted(finals) == [0, 1, 2] and all(f.token_ids == alone for f in finals.values())
    assert engine.stats().kv_blocks.used == 0 and all(c == 0 for c in engine.blocks.ref_counts)
    assert not engine.seqs and not engine.lora_slots.users and not engine.host.pins and engine.scheduler.fork_seats == 0


def test_preempted_choices_recompute_their_own_tokens(tiny_model_dir):
    prompts = random_prompts(4, (20, 40), VOCAB, seed=18)
    params = [SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    roomy = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=128, max_model_len=128, block_size=16)
    tight = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=9, max_model_len=64, block_size=16)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    assert tight.engine.stats().scheduler.preemptions > 0
    assert got == expected
    assert tight.engine.stats().kv_blocks.used == 0 and all(c == 0 for c in tight.engine.blocks.ref_counts)


def test_every_choice_counts_for_fair_share_and_max_num_seqs(tiny_model_dir):
    from server.engine import RequestError

    llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=64, max_model_len=256, max_num_seqs=4)
    engine = llm.engine
    prompt = random_prompts(1, (10, 10), VOCAB, seed=19)[0]
    engine.add_request("one", prompt, greedy(5), tenant="t1")
    engine.add_request("three", prompt, SamplingParams(n=3, max_tokens=5, temperature=0.0, ignore_eos=True),
                       tenant="t3")
    engine.add_request("other", prompt, greedy(5), tenant="t1")
    peaks = []
    drive(engine, lambda e: peaks.append(len(e.scheduler.running)))
    assert max(peaks) <= 4  # the three choices and one more, never five
    counters = engine.scheduler.waiting.counters
    assert counters["t3"] == 10 * 1.0 + 3 * 5 * 2.0  # the prompt once, the output of every choice
    assert engine.scheduler.fork_seats == 0
    with pytest.raises(RequestError, match="n"):
        engine.add_request("five", prompt, SamplingParams(n=5, max_tokens=2))


@pytest.mark.parametrize("cap", [None, 16])
def test_prefill_tokens_are_capped_while_others_decode(tiny_model_dir, tiny_adapters, peft_oracle, cap):
    """A long prompt that arrives while others decode is prefilled in chunks of at most the cap, each
    step still carrying every decoding sequence; without a cap it takes one step. Tokens stay PEFT's."""
    llm = LLM(tiny_model_dir, device="cpu", max_loras=4, kv_cache_blocks=128, max_model_len=256,
              max_num_batched_tokens=256, max_prefill_tokens_while_decoding=cap)
    for name, path in tiny_adapters.items():
        llm.add_adapter(name, path)
    engine = llm.engine
    names = ["r8_all", None, "r4_qv"]
    prompts = random_prompts(2, (8, 12), VOCAB, seed=21) + random_prompts(1, (150, 150), VOCAB, seed=22)
    for i, (prompt, name) in enumerate(zip(prompts[:2], names)):
        engine.add_request(f"d{i}", prompt, greedy(40), llm._versions[name] if name else None)
    engine.step()  # both short prompts prefilled: from here on they decode
    steps: list[tuple[int, int]] = []  # (prompt tokens, decoding sequences) per step
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        steps.append((sum(n for n in batch.num_tokens if n > 1), sum(n == 1 for n in batch.num_tokens)))
        return batch

    engine.scheduler.schedule = recording_schedule
    engine.add_request("long", prompts[2], greedy(40), llm._versions["r4_qv"])
    final = drive(engine)
    prefill_steps = [p for p, _ in steps if p > 0]
    assert sum(prefill_steps) == 150
    if cap is None:
        assert prefill_steps == [150]
    else:
        assert max(prefill_steps) <= cap and len(prefill_steps) >= 150 // cap
        assert all(d >= 2 for p, d in steps if p > 0)  # every chunk's step still decodes both others
    outs = [final["d0"], final["d1"], final["long"]]
    assert_matches_peft(llm, tiny_model_dir, tiny_adapters, prompts, names, outs, 40, peft_oracle)


def test_two_tenants_long_prompts_share_each_step_while_a_third_decodes(tiny_model_dir, tiny_adapters, peft_oracle):
    """Two tenants' equal long prompts, arriving while a third tenant decodes, are prefilled side by side
    in equal chunks (fair share of the step's cap, counted in decode-token equivalents), every such step
    still carrying the decoding stream; tokens stay PEFT's."""
    llm = LLM(tiny_model_dir, device="cpu", max_loras=4, kv_cache_blocks=128, max_model_len=256,
              max_num_batched_tokens=256, max_prefill_tokens_while_decoding=32)
    for name, path in tiny_adapters.items():
        llm.add_adapter(name, path)
    engine = llm.engine
    names = [None, "r8_all", "r4_qv"]
    prompts = random_prompts(1, (8, 8), VOCAB, seed=31) + random_prompts(2, (140, 140), VOCAB, seed=32)
    engine.add_request("victim", prompts[0], greedy(60), None, tenant="victim")
    engine.step()  # the victim's prompt is in: it decodes from here on
    steps: list[tuple[dict, bool]] = []  # (prompt chunks per tenant, the victim ran if it was running)
    schedule = engine.scheduler.schedule

    def recording_schedule():
        running = any(s.tenant == "victim" for s in engine.scheduler.running)
        batch = schedule()
        chunks = {s.tenant: n for s, n in zip(batch.seqs, batch.num_tokens)  # prompt chunks short of the end
                  if s.tenant != "victim" and n < s.num_pending_tokens}
        steps.append((chunks, not running or any(s.tenant == "victim" for s in batch.seqs)))
        return batch

    engine.scheduler.schedule = recording_schedule
    for tenant, prompt, name in zip("ab", prompts[1:], names[1:]):
        engine.add_request(tenant, prompt, greedy(20), llm._versions[name], tenant=tenant)
    final = drive(engine)
    assert all(victim_ran for _, victim_ran in steps)
    both = [chunks for chunks, _ in steps if len(chunks) == 2]
    # Equal shares of the cap's cost: a prompt a token ahead pays a little more attention per token, and
    # what the two shares leave over (under one token's cost each) goes to one of them.
    assert len(both) >= 140 // 16 and all(abs(c["a"] - c["b"]) <= 1 for c in both)
    assert not engine.scheduler.config.step_cost.plain
    assert all(c["a"] < 16 for c in both[1:])  # past the first chunk a token costs more than one
    assert_matches_peft(llm, tiny_model_dir, tiny_adapters, prompts[:1], names[:1], [final["victim"]], 60,
                        peft_oracle)
    assert_matches_peft(llm, tiny_model_dir, tiny_adapters, prompts[1:], names[1:], [final["a"], final["b"]], 20,
                        peft_oracle)
