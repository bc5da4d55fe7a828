"""--unified-memory: KV blocks and adapter pages drawn from one pool (server.engine.unified_memory).

Mixed ranks through churn still serve what transformers + peft serve; KV growth evicts an idle adapter's
pages before it preempts anyone and never evicts an adapter in use; an adapter load preempts, by the
existing rule, only requests newer than its own; pages handed from one adapter to the next never show the
first one's rows; the stats report the pool's split exactly as the engine holds it.
"""
from __future__ import annotations


import pytest
import torch

from adapters.format import load_adapter_dir
from server.engine import EngineConfig, LLMEngine
from server.engine.block_manager import FREED
from server.engine.unified_memory import UnifiedPool, unified_refusal
from tests.engine_helpers import drive, greedy, random_prompts
from tests.server.engine.lora.test_engine_rank_pages import (VOCAB, churn_matches_peft, mixed_rank_adapters,
                                                             skewed_requests)
from tests.server.engine.test_adapter_paging import PeftMultiOracle, write_adapter


def unified_engine(model_dir, kv_cache_blocks: int, **kw) -> LLMEngine:
    """Rank rows in pages of 4 (a page is 4 KV blocks of the tiny model), 2 rank-16 slots' worth of pages."""
    cfg = dict(model=str(model_dir), device="cpu", max_loras=2, max_lora_rank=16, lora_page_rows=4,
               kv_cache_blocks=kv_cache_blocks, max_num_seqs=6, max_model_len=128, unified_memory=True) | kw
    return LLMEngine(EngineConfig.of(**cfg))


def check_split(engine: LLMEngine) -> None:
    """The stats' split is the engine's state: lent blocks are exactly the resident adapters' pages' units,
    disjoint from every sequence's blocks and from the prefix index; the pages a slot holds past its rank
    read zeros, and its page-table row names the zero page past its pages."""
    slots, blocks = engine.lora_slots, engine.blocks
    units = slots.units
    lent = [b for held in units.held.values() for b in held]
    pages = sum(len(p) for p in slots.slot_pages.values())
    assert len(lent) == len(set(lent)) == pages * units.pool.units_per_page == blocks.num_lent_blocks
    assert set(units.held) == set(slots.slot_pages)
    per = units.pool.units_per_page
    for slot, held in slots.slot_pages.items():  # page p is the memory of the aligned group p - 1
        assert units.held[slot] == [(p - 1) * per + j for p in held for j in range(per)]
    seq_blocks = {b for s in engine.scheduler.running for b in s.block_table if b != FREED}
    assert not set(lent) & seq_blocks and not set(lent) & set(blocks.entries)
    s = engine.stats()
    assert (s.kv_blocks.used, s.kv_blocks.lent, s.kv_blocks.total) == (len(seq_blocks), len(lent), units.pool.units)
    assert s.slots.resident == len(slots.slot_of) and s.slots.pages_used == pages
    rows = slots.paging.page_rows
    for slot, held in slots.slot_pages.items():
        rank = slots.slot_ranks[slot]
        assert (slots.page_table[slot, len(held):] == 0).all()
        if rank % rows:
            for groups in slots.layers:
                for g in groups.values():
                    assert g.a[:, held[-1], rank % rows:].abs().sum() == 0
                    assert all(b[held[-1], :, rank % rows:].abs().sum() == 0 for b in g.b)


def test_mixed_ranks_through_churn_in_one_pool_match_peft(tiny_model_dir, tiny_adapters, tmp_path):
    """12 adapters of ranks 2..16 and longer prompts in a 48-unit pool: adapters and KV trade units every few
    steps (loads, evictions for KV, reloads into other pages); every step checked, every output exact."""
    dirs = mixed_rank_adapters(tiny_adapters, tmp_path, seed=70)
    engine = unified_engine(tiny_model_dir, kv_cache_blocks=16)
    pool = engine.lora_slots.units.pool
    assert (pool.units, pool.units_per_page, pool.kv_share, pool.adapter_share) == (48, 4, 16, 32)
    names, prompts = skewed_requests(engine, dirs, 30, (20, 60), seed=5, prompt_seed=11)
    most = {"kv": 0, "adapter": 0}

    def check(engine: LLMEngine) -> None:
        check_split(engine)
        kv = engine.stats().kv_blocks
        most["kv"], most["adapter"] = max(most["kv"], kv.used), max(most["adapter"], kv.lent)

    moved = churn_matches_peft(engine, tiny_model_dir, dirs, names, prompts, 6, check)
    slots = engine.lora_slots
    assert slots.evictions > 5 and any(len(p) > 1 for p in moved.values()) and not slots.users
    assert most["kv"] > pool.kv_share and most["adapter"] > 0  # the KV took units of the adapter share
    engine.shutdown()


@pytest.mark.parametrize("pin_idle", [False, True])
def test_kv_growth_evicts_idle_adapters_before_preempting_and_never_one_in_use(tiny_model_dir, tiny_adapters,
                                                                               tmp_path, pin_idle):
    """40 units: an idle rank-16 adapter (16 units), a busy one (16) and 8 free. Base requests growing past
    the free units take the idle adapter's pages first; past those they preempt, and the busy adapter stays.
    Pinned, the idle adapter stays too: the requests preempt instead."""
    dirs = {n: write_adapter(tiny_adapters["r8_all"], tmp_path / n, 16, seed=s) for n, s in (("idle", 1), ("busy", 2))}
    engine = unified_engine(tiny_model_dir, kv_cache_blocks=8)
    for name, d in dirs.items():
        engine.add_adapter(name, load_adapter_dir(d, engine.adapter_shape, 16))
    engine.add_request("warm", random_prompts(1, (5, 5), VOCAB, seed=1)[0], greedy(1), "idle")
    drive(engine)
    slots = engine.lora_slots
    assert len(slots.slot_of) == 1 and not slots.users
    idle_version = next(iter(slots.slot_of))
    if pin_idle:
        assert engine.pin_adapter(idle_version, None)
    prompts = random_prompts(4, (40, 40), VOCAB, seed=2)
    engine.add_request("busy", prompts[0][:10], greedy(100), "busy")
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(f"base{i}", prompt, greedy(80), None)
    seen: list[tuple[bool, int]] = []  # per step: idle adapter still resident, preemptions so far

    def check(engine: LLMEngine) -> None:
        check_split(engine)
        running = {s.request_id: s for s in engine.scheduler.running}
        if "busy" in running:
            assert running["busy"].version_id in slots.slot_of and slots.users[running["busy"].version_id] >= 1
        seen.append((idle_version in slots.slot_of, engine.stats().scheduler.preemptions))

    final = drive(engine, check)
    first_preemption = next(i for i, (_, p) in enumerate(seen) if p)
    if pin_idle:
        assert all(resident for resident, _ in seen)  # (the busy adapter may go once its request is done)
    else:
        assert any(not resident for resident, p in seen if p == 0)  # evicted while nobody was preempted yet
        assert not any(resident for resident, _ in seen[first_preemption:])
    oracle = PeftMultiOracle(tiny_model_dir)
    assert final["busy"].token_ids == oracle(dirs["busy"], "busy", prompts[0][:10], 100)
    for i, prompt in enumerate(prompts[1:]):
        assert final[f"base{i}"].token_ids == oracle(None, None, prompt, 80)
    engine.shutdown()


def test_an_adapter_load_preempts_only_newer_requests_when_kv_fills_the_pool(tiny_model_dir, tiny_adapters,
                                                                             tmp_path):
    """Four base requests fill 28 of 40 units with KV; a rank-16 adapter needs 16 (and its prompt a block,
    one more kept spare). Newer than them, its request waits; older (as a preempted request readmitted
    is), it preempts the newest one and runs."""
    d = write_adapter(tiny_adapters["r8_all"], tmp_path / "big", 16, seed=3)
    engine = unified_engine(tiny_model_dir, kv_cache_blocks=8)
    engine.add_adapter("big", load_adapter_dir(d, engine.adapter_shape, 16))
    prompts = random_prompts(5, (100, 100), VOCAB, seed=4)
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"base{i}", prompt, greedy(28), None)
    engine.step()
    assert len(engine.scheduler.running) == 4 and engine.blocks.num_free_blocks < 18
    engine.add_request("x", prompts[4][:8], greedy(8), "big")
    engine.step()
    assert [s.request_id for s in engine.scheduler.running if s.request_id == "x"] == []
    assert engine.stats().scheduler.preemptions == 0
    x = next(s for s in engine.scheduler.waiting.ordered() if s.request_id == "x")
    x.arrival = -1  # older than every running request
    engine.step()
    running = [s.request_id for s in engine.scheduler.running]
    assert "x" in running and engine.stats().scheduler.preemptions == 1
    assert sorted(r for r in running if r != "x") == ["base0", "base1", "base2"]  # the newest went
    check_split(engine)
    final = drive(engine, check_split)
    oracle = PeftMultiOracle(tiny_model_dir)
    assert final["x"].token_ids == oracle(d, "big", prompts[4][:8], 8)
    for i, prompt in enumerate(prompts[:4]):
        assert final[f"base{i}"].token_ids == oracle(None, None, prompt, 28)
    engine.shutdown()


def test_refusals_are_one_line():
    assert "lora_page_rows" in str(pytest.raises(ValueError, EngineConfig.of, model="m", unified_memory=True).value)
    assert "--tensor-parallel-size 2" in unified_refusal(2, False, False)
    assert "draft model" in unified_refusal(1, True, False)
    assert "KV layer groups" in unified_refusal(1, False, True)
    assert unified_refusal(1, False, False) is None


def test_pool_is_the_two_budgets_in_whole_units_per_page():
    pool = UnifiedPool.of(kv_blocks=10, unit_bytes=1000, page_bytes=2500, budget_pages=4)
    assert (pool.units, pool.units_per_page, pool.kv_share, pool.adapter_share, pool.pages) == (22, 3, 10, 12, 7)
    # CUDA: what the device has left holds the zero page and the adapter budget; the rest is the KV share.
    pool = UnifiedPool.within(units=25, unit_bytes=1000, page_bytes=2500, budget_pages=4)
    assert (pool.units, pool.kv_share, pool.adapter_share, pool.page_bytes) == (22, 10, 12, 3000)
    assert UnifiedPool.within(units=15, unit_bytes=1000, page_bytes=2500, budget_pages=4) is None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_kv_and_adapter_pages_are_views_of_one_allocation(tiny_model_dir, tiny_adapters, tmp_path):
    """Every layer's K and V and every group's A and B are strided views of the one buffer; a lent unit
    written through a page view is read through the KV view of its block, and the KV a lent page's units
    held (NaN here) is zeroed before the adapter is copied in: its output is PEFT's."""
    engine = unified_engine(tiny_model_dir, kv_cache_blocks=16)
    runner, slots = engine.runner, engine.lora_slots
    memory = _storage(slots.units.page_bytes)
    views = [t for kv in runner.kv_caches for t in kv] + [t for groups in slots.layers for g in groups.values()
                                                          for t in (g.a, *g.b)]
    assert all(_storage(t) == memory for t in views) and not runner.kv_caches[0][0].is_contiguous()
    for k, v in runner.kv_caches:
        k.fill_(float("nan"))  # every unit free, as if KV had been written everywhere
        v.fill_(float("nan"))
    d = write_adapter(tiny_adapters["r8_all"], tmp_path / "r6", 6, seed=9)
    engine.add_adapter("r6", load_adapter_dir(d, engine.adapter_shape, 16))
    prompt = random_prompts(1, (12, 12), VOCAB, seed=3)[0]
    engine.add_request("x", prompt, greedy(6), "r6")
    final = drive(engine, check_split)
    assert final["x"].token_ids == PeftMultiOracle(tiny_model_dir)(d, "r6", prompt, 6)
    (slot, (page, *_)), = slots.slot_pages.items()  # idle, still resident: rank 6 is 2 pages of 4 rows
    block = (page - 1) * slots.units.pool.units_per_page  # the first unit of its page
    a = slots.layers[0]["qkv"].a  # [S, P, rows, in]: the first bytes of a page are slice 0's row 0
    k = runner.kv_caches[0][0]  # [units, block_size, Hkv, D]: a unit's first bytes are token 0's layer-0 K
    d = k.shape[3]
    a[0, page, 0, :d] = torch.arange(d, dtype=a.dtype)
    assert torch.equal(k[block, 0, 0].view(torch.uint8), a[0, page, 0, :d].view(torch.uint8))
    engine.shutdown()


def test_fp8_kv_in_the_pool_serves_what_its_own_pool_serves(tiny_model_dir, tiny_adapters, tmp_path):
    """fp8 KV blocks are views of the same byte buffer as the float32 adapter pages: the tokens are those
    of the same engine without --unified-memory."""
    d = write_adapter(tiny_adapters["r8_all"], tmp_path / "r8", 8, seed=4)
    prompts = random_prompts(3, (20, 40), VOCAB, seed=8)
    outs = []
    for unified in (False, True):
        engine = unified_engine(tiny_model_dir, kv_cache_blocks=16, kv_cache_dtype="fp8_e4m3",
                                unified_memory=unified)
        assert engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        engine.add_adapter("r8", load_adapter_dir(d, engine.adapter_shape, 16))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy(10), "r8" if i % 2 else None)
        outs.append({r: o.token_ids for r, o in drive(engine, check_split if unified else None).items()})
        engine.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="--unified-memory on CUDA needs a GPU")
def test_on_cuda_the_pool_serves_what_separate_buffers_serve(tiny_model_dir, tiny_adapters, tmp_path):
    """On a GPU (the allocation is the point there): mixed ranks through churn give the tokens the same
    engine gives with its own KV and page buffers (one request at a time, so the steps' shapes are the
    same in both and only the views' strides differ); the views share the one buffer."""
    dirs = mixed_rank_adapters(tiny_adapters, tmp_path, seed=71)
    outs = []
    for unified in (False, True):
        engine = unified_engine(tiny_model_dir, kv_cache_blocks=16, device="cuda", unified_memory=unified)
        if unified:
            memory = _storage(engine.lora_slots.units.page_bytes)
            assert all(_storage(t) == memory for kv in engine.runner.kv_caches for t in kv)
        names, prompts = skewed_requests(engine, dirs, 16, (20, 60), seed=6, prompt_seed=12)
        out = {}
        for i, (name, prompt) in enumerate(zip(names, prompts)):
            engine.add_request(str(i), prompt, greedy(8), name)
            out |= {r: o.token_ids for r, o in drive(engine, check_split if unified else None).items()}
        outs.append(out)
        engine.shutdown()
    assert outs[0] == outs[1] and len(outs[0]) == 20
