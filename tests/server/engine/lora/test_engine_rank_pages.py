"""An engine whose adapter memory is paged by rank (--lora-page-rows) serves what transformers + peft
serve: mixed ranks through page churn (loads, evictions, reloads into other pages, holes between
resident adapters), DoRA and LoRA adapters side by side, padded decode and the Triton kernels; pages no
adapter holds stay zero throughout."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from server.engine import EngineConfig, LLMEngine
from adapters.format import load_adapter_dir
from tests.engine_helpers import drive, greedy, random_prompts
from tests.server.engine.lora.test_engine_dora import (  # noqa: F401 (fixtures)
    DORA, LORA, adapter_dirs, check, make_llm, params, reference, staged_keys)
from tests.server.engine.test_adapter_paging import PeftMultiOracle, write_adapter

VOCAB = 512


def check_pool(engine: LLMEngine) -> None:
    """Every running request's adapter is resident, resident adapters hold disjoint pages, and the zero
    page and every free page are zero in every buffer (--unified-memory: the zero page only, a free page's
    units being KV blocks; a lent page is zeroed before its load, test_engine_unified_memory)."""
    slots = engine.lora_slots
    for seq in engine.scheduler.running:
        if seq.version_id:
            assert seq.version_id in slots.slot_of
    held = [p for pages in slots.slot_pages.values() for p in pages]
    assert len(held) == len(set(held)) and 0 not in held
    empty = [0, *slots.free_pages] if slots.units is None else [0]
    for groups in slots.layers:
        for g in groups.values():
            assert g.a[:, empty].abs().sum() == 0 and all(b[empty].abs().sum() == 0 for b in g.b)


def mixed_rank_adapters(tiny_adapters, tmp_path, seed: int) -> dict[str, Path]:
    """12 adapters, of ranks 2, 4, 8 and 16 in turn."""
    return {f"a{i:02d}": write_adapter(tiny_adapters["r8_all"], tmp_path / f"a{i:02d}", (2, 4, 8, 16)[i % 4],
                                       seed=seed + i) for i in range(12)}


def skewed_requests(engine: LLMEngine, dirs: dict[str, Path], n: int, lengths: tuple[int, int], seed: int,
                    prompt_seed: int) -> tuple[list[str | None], list[list[int]]]:
    """`dirs`' adapters added to `engine`; n requests' adapters, the first ones more often, and 4 base-model
    ones, shuffled, and their prompts of `lengths` tokens."""
    for name, d in dirs.items():
        engine.add_adapter(name, load_adapter_dir(d, engine.adapter_shape, engine.config.lora.max_lora_rank))
    rng = random.Random(seed)
    names = [f"a{int(len(dirs) * rng.random() ** 1.5):02d}" for _ in range(n)] + [None] * 4
    rng.shuffle(names)
    return names, random_prompts(len(names), lengths, VOCAB, seed=prompt_seed)


def churn_matches_peft(engine: LLMEngine, model_dir, dirs: dict[str, Path], names: list[str | None],
                       prompts: list[list[int]], tokens: int, check=None) -> dict[str, set[tuple[int, ...]]]:
    """Runs the requests to the end, checking the pool (and `check(engine)`) after every step; every output
    is peft's. Returns the page tuples each adapter version was seen holding."""
    moved: dict[str, set[tuple[int, ...]]] = {}

    def each_step(engine: LLMEngine) -> None:
        check_pool(engine)
        if check is not None:
            check(engine)
        slots = engine.lora_slots
        for version, slot in slots.slot_of.items():
            moved.setdefault(version, set()).add(slots.slot_pages[slot])

    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"q{i}", prompt, greedy(tokens), name)
    final = drive(engine, each_step)
    oracle = PeftMultiOracle(model_dir)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert final[f"q{i}"].token_ids == oracle(dirs[name] if name else None, name, prompt, tokens), name
    return moved


def test_mixed_ranks_through_page_churn_match_peft(tiny_model_dir, tiny_adapters, tmp_path):
    """12 adapters of ranks 2..16 in two rank-16 slots' worth of pages (8 pages of 4 rows): they load,
    are evicted and come back into other pages, every step checked."""
    dirs = mixed_rank_adapters(tiny_adapters, tmp_path, seed=50)
    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", max_loras=2, max_lora_rank=16,
                                       lora_page_rows=4, kv_cache_blocks=128, max_model_len=256, max_num_seqs=6))
    assert engine.lora_slots.paging.pages == 9 and engine.lora_slots.max_loras == 4
    names, prompts = skewed_requests(engine, dirs, 40, (4, 12), seed=3, prompt_seed=9)
    moved = churn_matches_peft(engine, tiny_model_dir, dirs, names, prompts, 4)
    slots = engine.lora_slots
    assert slots.evictions > 5 and any(len(p) > 1 for p in moved.values())  # reloaded into other pages
    assert slots.stats().pages_used <= 8 and not slots.users
    engine.shutdown()


def test_dora_and_lora_of_mixed_ranks_in_pages_match_peft_logprobs(tiny_model_dir, adapter_dirs, reference):
    """DoRA magnitudes stay per adapter entry while A and B move between pages: 1e-4 logprobs."""
    llm = make_llm(tiny_model_dir, adapter_dirs, (*LORA, *DORA), max_loras=2, max_lora_rank=16, lora_page_rows=4)
    names = ["dora_r8_all", "r8_all", "dora_r4_qv", None, "dora_r16_rslora", "r4_qv", "dora_r16_pattern",
             "dora_r8_all", "r8_all"]
    prompts = random_prompts(len(names), (5, 30), VOCAB, seed=85)
    p = params(5)
    check(llm.generate(prompts, p, adapters=names), prompts, names, p, reference)
    one_by_one = [llm.generate([q], p, adapters=[n])[0] for q, n in zip(prompts, names)]
    check(one_by_one, prompts, names, p, reference)
    slots = llm.engine.lora_slots
    assert slots.paging.paged and slots.evictions > 0
    check_pool(llm.engine)


def test_padded_decode_through_the_page_table(tiny_model_dir, adapter_dirs, reference):
    llm = make_llm(tiny_model_dir, adapter_dirs, (*LORA, *DORA), max_num_seqs=8, max_lora_rank=16,
                   lora_page_rows=8)
    cfg, slots = llm.engine.config, llm.engine.lora_slots
    keys = staged_keys(llm.engine.runner.use_padded_decode(slots.max_loras, cfg.scheduler.max_num_seqs,
                                                           cfg.scheduler.max_model_len))
    p = params(4)
    names = ["dora_r8_all", None, "r4_qv", "dora_r16_rslora", "dora_r4_qv", "r8_all"]
    prompts = random_prompts(len(names), (5, 20), VOCAB, seed=86)
    check(llm.generate(prompts, p, adapters=names), prompts, names, p, reference)
    assert (8, True, True) in keys  # decode steps ran padded, DoRA rows among them


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton needs a GPU or the interpreter")
def test_triton_kernels_read_through_the_page_table(tiny_model_dir, adapter_dirs, reference):
    llm = make_llm(tiny_model_dir, adapter_dirs, (*LORA, "dora_r8_all"), kernels="triton", max_loras=1,
                   max_lora_rank=16, lora_page_rows=4)
    names = ["dora_r8_all", "r4_qv", None, "r8_all"]
    prompts = random_prompts(len(names), (5, 20), VOCAB, seed=87)
    p = params(3)
    check(llm.generate(prompts, p, adapters=names), prompts, names, p, reference)
