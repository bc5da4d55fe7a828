"""Prefix caching: cached prompt blocks change nothing but the work done.

Outputs with the cache equal outputs without it and transformers + peft's
greedy tokens (float32), across adapters, chunked prefill, preemption and
n > 1 forks; cached KV never crosses adapter versions, tenants or salts; and
the block pool's accounting holds after every step.
"""
from __future__ import annotations

from collections import Counter

import pytest

from server.engine import LLM, SamplingParams
from server.engine.block_manager import BlockManager
from tests.engine_helpers import drive, greedy, random_prompts

pytestmark = pytest.mark.unit

VOCAB = 512
BLOCK = 16


def make_llm(model_dir, adapters=None, names=(), cache=True, **kw) -> LLM:
    opts = dict(device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=96, max_model_len=256,
                max_num_batched_tokens=64, block_size=BLOCK, kernels="torch")
    llm = LLM(model_dir, **{**opts, **kw})
    llm.engine.set_prefix_cache_policy(cache)
    for name in names:
        llm.add_adapter(name, adapters[name])
    return llm


def check_blocks(engine) -> None:
    """The pool's invariants, for drive(check=...): every reference is a running sequence's, a block
    in use is never free or evictable, and a cached block is full and computed by whoever holds it."""
    blocks = engine.blocks
    # Every KV layer group's table (server.engine.group_blocks): one pool, one count.
    held = Counter(b for seq in engine.scheduler.running for t in (seq.block_table, *seq.group_tables) for b in t)
    assert all(not seq.block_table and not any(seq.group_tables) for seq in engine.scheduler.waiting.ordered())
    assert [blocks.ref_counts[b] for b in range(blocks.num_blocks)] == [held[b] for b in range(blocks.num_blocks)]
    free, evictable = set(blocks.free_blocks), set(blocks.evictable)
    assert len(free) == len(blocks.free_blocks) and not free & evictable
    assert free | evictable == {b for b in range(blocks.num_blocks) if not held[b]}
    assert evictable <= set(blocks.entries)
    assert {b: h for h, b in blocks.cached.items()} == {b: h for b, (h, _) in blocks.entries.items()}
    assert set(blocks.senders) == set(blocks.entries) and all(blocks.senders.values())
    for version, mine in blocks.by_version.items():
        assert mine and all(blocks.entries[b][1] == version for b in mine)
    for seq in engine.scheduler.running:
        for i, b in enumerate(seq.block_table):
            if b in blocks.entries:
                assert (i + 1) * BLOCK <= seq.num_computed_tokens, "a block still being written is cached"


def run(llm: LLM, requests: dict, check=check_blocks) -> dict:
    """requests: id -> (prompt, params, adapter name or None, add_request keywords)."""
    for rid, (prompt, params, name, kw) in requests.items():
        llm.engine.add_request(rid, prompt, params, llm._versions[name] if name else None, **kw)
    return drive(llm.engine, check)


def req(prompt, max_tokens=6, name=None, **kw):
    return prompt, greedy(max_tokens), name, kw


def with_prefix(prefix: list[int], n: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    return [prefix + tail for tail in random_prompts(n, lengths, VOCAB, seed)]


def test_mixed_adapters_match_cache_off_and_peft(tiny_model_dir, tiny_adapters, peft_oracle):
    names = ["r8_all", None, "r32_pattern", "r4_qv"]
    prefix = random_prompts(1, (40, 40), VOCAB, seed=1)[0]
    first = with_prefix(prefix, 4, (5, 20), seed=2)
    second = with_prefix(prefix, 4, (5, 30), seed=3) + [first[0], first[1][:-1]]
    later_names = names + names[:2]
    outs = {}
    for cache in (True, False):
        llm = make_llm(tiny_model_dir, tiny_adapters, names[::2] + names[3:], cache=cache)
        a = run(llm, {f"a{i}": req(p, 6, n) for i, (p, n) in enumerate(zip(first, names))})
        b = run(llm, {f"b{i}": req(p, 6, n) for i, (p, n) in enumerate(zip(second, later_names))})
        outs[cache] = {**a, **b}
        stats = llm.engine.stats()
        if cache:
            # The second wave starts from the first wave's blocks: the prefix's 2 full blocks, and for
            # a resent prompt every full block it has but the one with its last token.
            assert [b[f"b{i}"].num_cached_tokens for i in range(4)] == [32] * 4
            assert b["b4"].num_cached_tokens == (len(first[0]) - 1) // BLOCK * BLOCK
            assert stats.prefix_cache.hit_tokens == sum(o.num_cached_tokens for o in outs[True].values()) > 0
        else:
            assert all(o.num_cached_tokens == 0 for o in outs[False].values())
            assert stats.prefix_cache.hit_tokens == stats.prefix_cache.queried_tokens == 0
        assert stats.kv_blocks.used == 0
    assert {k: o.token_ids for k, o in outs[True].items()} == {k: o.token_ids for k, o in outs[False].items()}
    for rid, prompt, name in [(f"a{i}", p, n) for i, (p, n) in enumerate(zip(first, names))] + \
                             [(f"b{i}", p, n) for i, (p, n) in enumerate(zip(second, later_names))]:
        expected = peft_oracle(tiny_model_dir, tiny_adapters[name] if name else None, prompt, 6)
        assert outs[True][rid].token_ids == expected, (rid, name)


def test_hit_on_a_prompt_still_in_chunked_prefill(tiny_model_dir, tiny_adapters, peft_oracle):
    # A 60-token budget: the 100-token lead prompt runs 60 tokens, then 40. The follower shares its first
    # 70 tokens and arrives after the first chunk, when blocks 0-2 are computed and block 3 only partly:
    # it reuses 48 tokens, never the block still being written, and prefills the rest in two chunks.
    llm = make_llm(tiny_model_dir, tiny_adapters, ["r16_rslora"], max_num_batched_tokens=60)
    engine = llm.engine
    version = llm._versions["r16_rslora"]
    lead = random_prompts(1, (100, 100), VOCAB, seed=4)[0]
    follower = lead[:70] + random_prompts(1, (20, 20), VOCAB, seed=5)[0]
    engine.add_request("lead", lead, greedy(5), version)
    engine.step()
    assert engine.blocks.num_cached_blocks == 3
    engine.add_request("follow", follower, greedy(5), version)
    engine.step()
    check_blocks(engine)
    follow = engine.seqs["follow"]
    assert engine.seqs["lead"].num_computed_tokens == 100 and follow.num_computed_tokens == 48 + 20
    assert follow.block_table[:3] == engine.seqs["lead"].block_table[:3]
    assert follow.block_table[3] != engine.seqs["lead"].block_table[3]
    final = drive(engine, check_blocks)
    assert final["follow"].num_cached_tokens == 48 and final["lead"].num_cached_tokens == 0
    for rid, prompt in (("lead", lead), ("follow", follower)):
        assert final[rid].token_ids == peft_oracle(tiny_model_dir, tiny_adapters["r16_rslora"], prompt, 5)


def test_hits_after_preemption_match_peft(tiny_model_dir, tiny_adapters, peft_oracle):
    # 8 sequences of ~50 + 30 tokens in 18 blocks of 16: preemption is certain. Preempted sequences
    # come back to find their own blocks (and the shared prefix) cached, unless evicted meanwhile.
    llm = make_llm(tiny_model_dir, tiny_adapters, ["r8_all", "r4_qv"], kv_cache_blocks=18, max_model_len=128)
    names = [None, "r8_all", "r4_qv", None] * 2
    prefix = random_prompts(1, (33, 33), VOCAB, seed=6)[0]
    prompts = with_prefix(prefix, 8, (10, 20), seed=7)
    final = run(llm, {f"r{i}": req(p, 30, n) for i, (p, n) in enumerate(zip(prompts, names))})
    stats = llm.engine.stats()
    assert stats.scheduler.preemptions > 0 and stats.prefix_cache.hit_tokens > 0
    assert stats.prefix_cache.queried_tokens > sum(len(p) for p in prompts)  # readmissions are looked up too
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert final[f"r{i}"].token_ids == peft_oracle(tiny_model_dir, tiny_adapters[name] if name else None,
                                                       prompt, 30), i
    assert stats.kv_blocks.used == 0 and all(c == 0 for c in llm.engine.blocks.ref_counts)


def finished_outputs(engine) -> list:
    """Every choice's final output, stepping until idle and checking the pool after each step."""
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        check_blocks(engine)
    return outs


def test_n_choices_fork_from_a_cached_prefix(tiny_model_dir, tiny_adapters, peft_oracle):
    prompt = random_prompts(1, (70, 70), VOCAB, seed=8)[0]
    expected = peft_oracle(tiny_model_dir, tiny_adapters["r8_all"], prompt, 8)
    sampled = {}
    for cache in (True, False):
        llm = make_llm(tiny_model_dir, tiny_adapters, ["r8_all"], cache=cache)
        engine, version = llm.engine, llm._versions["r8_all"]
        run(llm, {"warm": req(prompt, 4, "r8_all")})
        engine.add_request("g", prompt, SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True), version)
        engine.add_request("s", prompt, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True),
                           version)
        outs = finished_outputs(engine)
        assert sorted((o.index, o.token_ids) for o in outs if o.request_id == "g") == [(i, expected) for i in range(3)]
        assert [o.num_cached_tokens for o in outs] == [64 if cache else 0] * 6  # 4 of the 4 full blocks
        sampled[cache] = sorted((o.index, o.token_ids) for o in outs if o.request_id == "s")
        assert engine.stats().kv_blocks.used == 0 and engine.scheduler.fork_seats == 0
    assert sampled[True] == sampled[False]


def test_replaced_adapter_never_reuses_the_old_versions_blocks(tiny_model_dir, tiny_adapters, peft_oracle):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    prompt = random_prompts(1, (60, 60), VOCAB, seed=9)[0]
    old = llm.add_adapter("a", tiny_adapters["r8_all"])
    run(llm, {"old": req(prompt, 5, "a")})
    assert old in engine.blocks.by_version and engine.stats().prefix_cache.cached_free_blocks >= 3
    hits = engine.stats().prefix_cache.hit_tokens
    llm.add_adapter("a", tiny_adapters["r4_qv"])  # same name, new weights, new version id
    assert old not in engine.blocks.by_version  # dropped at once, nobody held them
    final = run(llm, {"new": req(prompt, 5, "a")})
    assert final["new"].num_cached_tokens == 0 and engine.stats().prefix_cache.hit_tokens == hits
    assert final["new"].token_ids == peft_oracle(tiny_model_dir, tiny_adapters["r4_qv"], prompt, 5)
    again = run(llm, {"again": req(prompt, 5, "a")})["again"]  # the new version's own blocks are fine
    assert again.num_cached_tokens == 48 and again.token_ids == final["new"].token_ids


def test_adapters_and_the_base_model_never_share_blocks(tiny_model_dir, tiny_adapters, peft_oracle):
    llm = make_llm(tiny_model_dir, tiny_adapters, ["r8_all", "r4_qv"])
    prompt = random_prompts(1, (50, 50), VOCAB, seed=14)[0]
    for i, name in enumerate(["r8_all", "r4_qv", None]):  # one tenant, one prompt, three sets of weights
        out = run(llm, {f"r{i}": req(prompt, 5, name, tenant="A")})[f"r{i}"]
        assert out.num_cached_tokens == 0, name
        assert out.token_ids == peft_oracle(tiny_model_dir, tiny_adapters[name] if name else None, prompt, 5)
    assert llm.engine.stats().prefix_cache.hit_tokens == 0


def test_a_version_retired_while_running_indexes_nothing_more(tiny_model_dir, tiny_adapters):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    version = llm.add_adapter("a", tiny_adapters["r8_all"])
    engine.add_request("r", random_prompts(1, (40, 40), VOCAB, seed=10)[0], greedy(40), version)
    engine.step()
    assert version in engine.blocks.by_version
    llm.remove_adapter("a")
    assert version not in engine.blocks.by_version
    final = drive(engine, check_blocks)  # the running request finishes, on blocks nobody can reuse
    assert final["r"].finish_reason == "length" and version not in engine.blocks.by_version
    assert engine.blocks.num_cached_blocks == 0 and len(engine.blocks.free_blocks) == engine.blocks.num_blocks


def test_tenants_never_share_base_blocks_unless_allowed(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    prompt = random_prompts(1, (50, 50), VOCAB, seed=11)[0]
    a = run(llm, {"a1": req(prompt, tenant="A")})["a1"]
    stats = engine.stats()
    b = run(llm, {"b1": req(prompt, tenant="B")})["b1"]
    assert b.num_cached_tokens == 0 and engine.stats().prefix_cache.hit_tokens == stats.prefix_cache.hit_tokens
    assert engine.stats().prefix_cache.queried_tokens == stats.prefix_cache.queried_tokens + len(prompt)
    a2 = run(llm, {"a2": req(prompt, tenant="A")})["a2"]
    assert a2.num_cached_tokens == 48 and a2.token_ids == a.token_ids == b.token_ids

    engine.set_prefix_cache_policy(True, share_base_across_tenants=True)
    assert engine.blocks.num_cached_blocks == 0  # new keys: nothing old is reachable
    run(llm, {"a3": req(prompt, tenant="A")})
    hits = engine.stats().prefix_cache.hit_tokens
    b2 = run(llm, {"b2": req(prompt, tenant="B")})["b2"]
    # B reuses A's blocks (the compute is saved) but is not told: that would say what A sent.
    assert engine.stats().prefix_cache.hit_tokens == hits + 48
    assert b2.num_cached_tokens == 0 and b2.token_ids == a.token_ids
    b3 = run(llm, {"b3": req(prompt, tenant="B")})["b3"]
    assert b3.num_cached_tokens == 48  # B sent it itself now, as it would be had A never sent it


def test_share_base_reports_what_the_tenant_sent_never_what_others_did(tiny_model_dir):
    # What B is told for the same requests is the same whether or not A sent the prompt first.
    prompt = random_prompts(1, (70, 70), VOCAB, seed=14)[0]
    longer = prompt + random_prompts(1, (40, 40), VOCAB, seed=15)[0]
    told = {}
    for a_first in (False, True):
        llm = make_llm(tiny_model_dir)
        llm.engine.set_prefix_cache_policy(True, share_base_across_tenants=True)
        if a_first:
            run(llm, {"a": req(prompt, tenant="A")})
        outs = [run(llm, {f"b{i}": req(p, tenant="B")})[f"b{i}"] for i, p in enumerate([prompt, prompt, longer])]
        told[a_first] = [o.num_cached_tokens for o in outs]
        if a_first:  # the compute was saved all the same
            assert llm.engine.stats().prefix_cache.hit_tokens == 64 + 64 + 64
    assert told[False] == told[True] == [0, 64, 64]


def test_a_salt_is_never_shared_across_tenants(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    llm.engine.set_prefix_cache_policy(True, share_base_across_tenants=True)
    prompt = random_prompts(1, (40, 40), VOCAB, seed=16)[0]
    run(llm, {"a": req(prompt, tenant="A", cache_salt="s")})
    hits = llm.engine.stats().prefix_cache.hit_tokens
    b = run(llm, {"b": req(prompt, tenant="B", cache_salt="s")})["b"]
    assert b.num_cached_tokens == 0 and llm.engine.stats().prefix_cache.hit_tokens == hits
    assert run(llm, {"a2": req(prompt, tenant="A", cache_salt="s")})["a2"].num_cached_tokens == 32


def test_share_base_never_shares_adapter_blocks(tiny_model_dir, tiny_adapters):
    llm = make_llm(tiny_model_dir, tiny_adapters, ["r8_all"])
    llm.engine.set_prefix_cache_policy(True, share_base_across_tenants=True)
    prompt = random_prompts(1, (50, 50), VOCAB, seed=12)[0]
    run(llm, {"a": req(prompt, name="r8_all", tenant="A")})
    b = run(llm, {"b": req(prompt, name="r8_all", tenant="B")})["b"]
    assert b.num_cached_tokens == 0
    base = run(llm, {"base": req(prompt, tenant="B")})["base"]  # the base model never reuses adapter KV
    assert base.num_cached_tokens == 0


def test_cache_salt_partitions_within_a_tenant(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    prompt = random_prompts(1, (40, 40), VOCAB, seed=13)[0]
    first = run(llm, {"x1": req(prompt, tenant="A", cache_salt="x")})["x1"]
    others = run(llm, {"y": req(prompt, tenant="A", cache_salt="y"), "none": req(prompt, tenant="A")})
    assert others["y"].num_cached_tokens == 0 and others["none"].num_cached_tokens == 0
    again = run(llm, {"x2": req(prompt, tenant="A", cache_salt="x")})["x2"]
    assert again.num_cached_tokens == 32 and again.token_ids == first.token_ids == others["y"].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        llm.engine.add_request("bad", prompt, greedy(2), cache_salt=7)


def test_eviction_under_pressure_keeps_blocks_in_use(tiny_model_dir, peft_oracle):
    # 24 blocks. Waves of distinct prompts fill the pool with cached blocks; later requests must evict
    # them (least recently released first) and never a block some sequence holds.
    llm = make_llm(tiny_model_dir, kv_cache_blocks=24, max_model_len=128, max_num_batched_tokens=48)
    engine = llm.engine
    waves = [random_prompts(4, (40, 70), VOCAB, seed=20 + w) for w in range(3)]
    for w, prompts in enumerate(waves):
        run(llm, {f"w{w}-{i}": req(p, 12) for i, p in enumerate(prompts)})
    stats = engine.stats()
    prefix = stats.prefix_cache
    assert prefix.cached_free_blocks > 0 and prefix.cached_blocks == prefix.cached_free_blocks
    assert engine.blocks.num_free_blocks == 24 and stats.kv_blocks.used == 0
    # Caching never shrinks what running requests can use: one request needing every block runs alone.
    long = random_prompts(1, (110, 110), VOCAB, seed=30)[0]
    preemptions = stats.scheduler.preemptions
    final = run(llm, {"long": req(long, 18)})
    assert engine.stats().scheduler.preemptions == preemptions
    assert final["long"].token_ids == peft_oracle(tiny_model_dir, None, long, 18)
    # Old prompts again, mixed with new ones, under pressure: whatever is still cached is reused.
    mixed = waves[2][:2] + random_prompts(4, (40, 70), VOCAB, seed=31)
    final = run(llm, {f"m{i}": req(p, 12) for i, p in enumerate(mixed)})
    for i, prompt in enumerate(mixed):
        assert final[f"m{i}"].token_ids == peft_oracle(tiny_model_dir, None, prompt, 12), i


def test_reviving_cached_blocks_counts_against_the_free_pool(tiny_model_dir, peft_oracle):
    # 8 blocks. P leaves 4 cached free blocks and 4 never-cached ones; R then holds 3 of the latter.
    # Q reuses P's 4 blocks and needs 3 more, plus 1 spare for R: 8 of the 5 free, so Q waits for R
    # (admitting it would take the cached blocks and leave too few for the rest).
    llm = make_llm(tiny_model_dir, kv_cache_blocks=8, max_model_len=128)
    engine = llm.engine
    p, r, tail = random_prompts(3, (40, 70), VOCAB, seed=45)
    p = (p * 2)[:70]
    run(llm, {"p": req(p, 3)})
    assert engine.stats().prefix_cache.cached_free_blocks == 4
    engine.add_request("r", r[:40], greedy(20))
    engine.step()
    q = p[:64] + (tail * 2)[:40]
    engine.add_request("q", q, greedy(3))
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["r"]
    final = drive(engine, check_blocks)
    assert final["q"].num_cached_tokens == 64 and engine.stats().scheduler.preemptions == 0
    assert final["q"].token_ids == peft_oracle(tiny_model_dir, None, q, 3)


def test_whole_prompt_cached_still_computes_its_last_block(tiny_model_dir, peft_oracle):
    llm = make_llm(tiny_model_dir)
    aligned = random_prompts(1, (64, 64), VOCAB, seed=40)[0]
    run(llm, {"first": req(aligned, 3)})
    final = run(llm, {"again": req(aligned, 3), "prefix": req(aligned[:40], 3), "tiny": req(aligned[:16], 3)})
    assert final["again"].num_cached_tokens == 48  # 4 full blocks cached; the one holding the last token runs
    assert final["prefix"].num_cached_tokens == 32
    assert final["tiny"].num_cached_tokens == 0  # one block: its last token must run
    for rid, prompt in (("again", aligned), ("prefix", aligned[:40]), ("tiny", aligned[:16])):
        assert final[rid].token_ids == peft_oracle(tiny_model_dir, None, prompt, 3), rid


def test_prompt_logprobs_requests_compute_their_prompt(tiny_model_dir):
    prompt = random_prompts(1, (50, 50), VOCAB, seed=41)[0]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    got = {}
    for cache in (True, False):
        llm = make_llm(tiny_model_dir, cache=cache)
        run(llm, {"warm": req(prompt, 2)})
        out = run(llm, {"lp": (prompt, params, None, {})})["lp"]
        got[cache] = out
        assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
    assert [e and (e.token_id, round(e.logprob, 5)) for e in got[True].prompt_logprobs] == \
           [e and (e.token_id, round(e.logprob, 5)) for e in got[False].prompt_logprobs]


def test_policy_changes_mid_run_drop_the_cache_and_rekey(tiny_model_dir, peft_oracle):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    prompt = random_prompts(1, (40, 40), VOCAB, seed=42)[0]
    run(llm, {"a": req(prompt)})
    assert engine.stats().prefix_cache.cached_blocks == 2 and engine.stats().prefix_cache.enabled
    engine.set_prefix_cache_policy(False)
    assert engine.stats().prefix_cache.cached_blocks == 0 and not engine.stats().prefix_cache.enabled
    assert run(llm, {"b": req(prompt)})["b"].num_cached_tokens == 0
    assert engine.blocks.num_cached_blocks == 0
    # Turned on (with new keys) while a request runs: its blocks are hashed under the new keys, so
    # the base request of another tenant, under shared base blocks, reuses them.
    engine.add_request("c", prompt, greedy(30), tenant="A")
    engine.step()
    engine.set_prefix_cache_policy(True, share_base_across_tenants=True)
    drive(engine, check_blocks)
    hits = engine.stats().prefix_cache.hit_tokens
    d = run(llm, {"d": req(prompt, 6, tenant="B")})["d"]
    assert engine.stats().prefix_cache.hit_tokens == hits + 32 and d.num_cached_tokens == 0  # A's blocks: not told
    assert d.token_ids == peft_oracle(tiny_model_dir, None, prompt, 6)


def test_async_engine_passes_the_cache_salt(tiny_model_dir):
    import asyncio

    from server.engine.async_engine import AsyncEngine
    from server.engine.protocol import EngineRequest

    llm = make_llm(tiny_model_dir)
    prompt = random_prompts(1, (40, 40), VOCAB, seed=43)[0]

    async def final(loop_engine, rid, salt):
        out = None
        request = EngineRequest(rid, prompt, greedy(3), tenant="A", cache_salt=salt)
        async for out in await loop_engine.submit(request):
            pass
        return out

    async def scenario():
        loop_engine = AsyncEngine(llm.engine)
        loop_engine.start()
        try:
            first = await final(loop_engine, "x1", "x")
            return first, await final(loop_engine, "y", "y"), await final(loop_engine, "x2", "x")
        finally:
            loop_engine.shutdown()

    first, other, again = asyncio.run(scenario())
    assert (first.num_cached_tokens, other.num_cached_tokens, again.num_cached_tokens) == (0, 0, 32)


def test_block_manager_evicts_least_recently_released_tails_first():
    bm = BlockManager(6, 4)
    a, b = [], []
    bm.grow(a, 12)  # blocks 0 1 2
    bm.grow(b, 8)  # blocks 3 4
    for i, block in enumerate(a + b):
        assert bm.index(block, bytes([i]) * 32, None)
    assert not bm.index(a[0], bytes([9]) * 32, None)  # already indexed
    bm.free(a)
    bm.free(b)
    assert list(bm.evictable) == [2, 1, 0, 4, 3] and bm.num_free_blocks == 6 and bm.num_used_blocks == 0
    bm.take([bm.lookup(bytes([0]) * 32)])  # block 0 reused: no longer evictable
    c = []
    bm.grow(c, 12)  # the never-indexed block 5, then the least recently released: 2, 1
    assert c == [5, 2, 1] and bm.lookup(bytes([2]) * 32) is None and bm.lookup(bytes([1]) * 32) is None
    assert list(bm.evictable) == [4, 3] and bm.num_free_blocks == 2


def test_block_manager_counts_the_blocks_a_tenant_sent_up_to_the_first_it_did_not():
    bm = BlockManager(6, 4)
    a, b = [], []
    bm.grow(a, 12)
    bm.grow(b, 4)
    for i, block in enumerate(a):
        assert bm.index(block, bytes([i]) * 32, None, "A")
    assert not bm.index(b[0], bytes([0]) * 32, None, "B")  # B computed block 0's content at the same time
    assert bm.sent_before(a, "A") == 3 and bm.sent_before(a, "B") == 1 and bm.sent_before(a, "C") == 0
    bm.add_sender(a[2:], "C")
    assert bm.sent_before(a, "C") == 0  # a later block alone says nothing: the count stops at the first
    bm.add_sender(a, "B")
    assert bm.sent_before(a, "B") == 3
