"""Sliding-window attention over the paged KV cache (server.engine.sliding_window): Mistral with every
layer windowed, Qwen2 with windowed and global layers, and Gemma 2 (alternating layers: two KV layer
groups of two) and Gemma 3 (three windowed layers to one global: four groups of one) give transformers +
peft's greedy tokens and logprobs (float32, 1e-4) for prompts and decodes past the window, through
chunked prefill (chunks whose queries straddle the window's edge), preemption, prefix hits, forks and
steps scheduled ahead, in mixed batches of adapters. Where every layer is windowed, the blocks wholly
behind a sequence's window go back to the pool as it runs; with KV layer groups (server.engine.kv_groups)
the windowed groups' blocks do, the global group's stay; a block so released serves a later prefix hit
only while its KV is intact."""
from __future__ import annotations

import os

import pytest
import torch

from server.demo import SEVEN, make_adapter, make_base_model
from server.engine import LLM, SamplingParams
from server.engine.block_manager import FREED, PrefixCache
from tests.engine_helpers import (
    GREEDY, assert_matches_peft, drive, generate_through_preemption_and_prefix_hits, random_prompts)
from tests.server.engine.test_engine_architectures import reference
from tests.server.engine.test_engine_logprobs import assert_matches
from tests.server.engine.sequences import request
from tests.server.engine.test_engine_prefix_cache import check_blocks

VOCAB = 512
BLOCK = 16
SLIDING, FULL = "sliding_attention", "full_attention"
# name -> (make_base_model's arch, layers, config overrides, the window behind which blocks are released or None)
MODELS = {
    # 20: not a multiple of the block size, so the window's edge falls inside a block.
    "mistral": ("mistral", 2, dict(sliding_window=20), 20),
    # Layer 0 global, layer 1 windowed (max_window_layers = 1): two KV layer groups of one.
    "qwen2": ("qwen2", 2, dict(use_sliding_window=True, sliding_window=12, max_window_layers=1), 12),
    "gemma2": ("gemma2", 4, dict(sliding_window=20, layer_types=[SLIDING, FULL] * 2, attn_logit_softcapping=2.0,
                                 final_logit_softcapping=5.0, query_pre_attn_scalar=24), 20),
    "gemma3": ("gemma3", 4, dict(sliding_window=20, layer_types=[SLIDING] * 3 + [FULL], final_logit_softcapping=5.0,
                                 query_pre_attn_scalar=24), 20),
}
# Each model's KV layer groups' windows, the global group first (None: one group).
GROUPS = {"mistral": None, "qwen2": (None, 12), "gemma2": (None, 20), "gemma3": (None, 20, 20, 20)}


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            arch, layers, overrides, _ = MODELS[name]
            root = tmp_path_factory.mktemp(f"window-{name}")
            model_dir = make_base_model(root / "base", arch, hidden_size=64, num_layers=layers, num_heads=4,
                                        num_kv_heads=2, intermediate_size=128, config_overrides=overrides)
            cache[name] = model_dir, {
                "r8_all": make_adapter(model_dir, root / "r8_all", r=8, target_modules=SEVEN, seed=51),
                "r4_qv": make_adapter(model_dir, root / "r4_qv", r=4, lora_alpha=8, use_rslora=True,
                                      target_modules=("q_proj", "v_proj"), seed=52),
                "dora_r16": make_adapter(model_dir, root / "dora_r16", r=16, lora_alpha=16, target_modules=SEVEN,
                                         seed=53, use_dora=True),
            }
        return cache[name]

    return get


def live(table: list[int]) -> int:
    return sum(b != FREED for b in table)


def windowed_tables(seq) -> list[list[int]]:
    """The tables released behind the window: the windowed KV layer groups' (server.engine.group_blocks),
    else the one table of a model windowed in every layer."""
    return seq.group_tables or [seq.block_table]


def window_bound(engine, window: int | None):
    """drive(check=...): the pool's invariants, and with a window no running sequence's windowed table
    holds more than its window, the step's chunk and a partial block at each end, while a global group's
    holds every position."""
    budget = engine.config.scheduler.max_num_batched_tokens

    def check(eng) -> None:
        check_blocks(eng)
        if window is not None:
            for seq in eng.scheduler.running:
                if seq.group_tables:
                    assert FREED not in seq.block_table
                for table in windowed_tables(seq):
                    assert len(table) == len(seq.block_table)
                    assert live(table) <= -(-(window + budget) // BLOCK) + 1, table

    return check


def test_model_configs_window_their_layers(windowed_model):
    from server.engine import ModelConfig

    mistral = ModelConfig.from_dir(windowed_model("mistral")[0])
    assert mistral.layer_windows == (20, 20) and mistral.kv_window == 20
    qwen2 = ModelConfig.from_dir(windowed_model("qwen2")[0])
    assert qwen2.layer_windows == (None, 12) and qwen2.kv_window is None
    for name, windows in GROUPS.items():
        groups = ModelConfig.from_dir(windowed_model(name)[0]).kv_groups
        assert (groups and groups.windows) == windows


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mixed_batch_past_the_window_matches_peft(name, windowed_model, peft_oracle):
    """Prompts of 5 to 90 tokens (3 chunks of 32 for the longest) and 30 decodes: most queries see only
    their window; adapters of three ranks (one DoRA) beside base rows."""
    model_dir, adapters = windowed_model(name)
    window = MODELS[name][3]
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=3, kv_cache_blocks=128, max_model_len=256,
              max_num_batched_tokens=32, kernels="torch")
    for adapter, path in adapters.items():
        llm.add_adapter(adapter, path)
    names = ["r8_all", None, "r4_qv", "dora_r16", None, "r8_all"]
    prompts = random_prompts(len(names), (5, 40), VOCAB, seed=54)
    prompts[3] = random_prompts(1, (90, 90), VOCAB, seed=55)[0]
    params = SamplingParams(max_tokens=30, logprobs=3, prompt_logprobs=2, **GREEDY)
    engine = llm.engine
    for i, (prompt, adapter) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}", prompt, params, llm._versions[adapter] if adapter else None)
    final = drive(engine, window_bound(engine, window))
    outs = [final[f"r{i}"] for i in range(len(prompts))]
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 30, peft_oracle)
    for prompt, adapter, out in zip(prompts, names, outs):
        assert_matches(out, prompt, params, reference(model_dir, adapter and adapters[adapter], prompt + out.token_ids))
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_preemption_and_prefix_hits_match_peft(name, windowed_model, peft_oracle):
    """Recomputed sequences and cached prefixes (some of whose blocks their writers had released behind
    the window, still intact) give the same tokens."""
    model_dir, dirs = windowed_model(name)
    adapters = {"r8_all": dirs["r8_all"], "r4_qv": dirs["r4_qv"]}
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=2, kv_cache_blocks=18, max_model_len=128,
              kernels="torch")
    for adapter, path in adapters.items():
        llm.add_adapter(adapter, path)
    prompts, names, outs = generate_through_preemption_and_prefix_hits(llm, VOCAB)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 24, peft_oracle)


# Blocks of every layer for a 240-token decode: Mistral's window, and room for Gemma's global group too.
LONG_DECODE_POOL = {"mistral": 8, "gemma2": 12, "gemma3": 8}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(LONG_DECODE_POOL))
def test_long_decode_holds_its_window(name, async_scheduling, windowed_model, peft_oracle):
    """One sequence decoding to 12x its window: each windowed table holds at most the window's blocks plus
    a partial one at each end, with the released ones marked FREED (steps scheduled ahead release too)."""
    model_dir, _ = windowed_model(name)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=1, kv_cache_blocks=LONG_DECODE_POOL[name],
              max_model_len=256, max_num_batched_tokens=32, kernels="torch", async_scheduling=async_scheduling)
    prompt = random_prompts(1, (30, 30), VOCAB, seed=56)[0]
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(max_tokens=210, **GREEDY))
    most = 0

    def check(eng) -> None:
        nonlocal most
        check_blocks(eng)
        for seq in eng.scheduler.running:
            if seq.num_pending_tokens == 1:  # decoding
                # Released before the step just run, whose query sat at num_computed_tokens - 1.
                behind = max(0, seq.num_computed_tokens - 20) // BLOCK
                for table in windowed_tables(seq):
                    most = max(most, live(table))
                    assert table[:behind] == [FREED] * behind
                if seq.group_tables:
                    assert live(seq.block_table) == len(seq.block_table) >= seq.num_computed_tokens // BLOCK

    out = drive(engine, check)["long"]
    assert most <= -(-20 // BLOCK) + 1  # 2 blocks of 16 cover any 20 positions but 1 + 16 + 3: 3
    assert engine.stats().scheduler.preemptions == 0  # 240 tokens in a pool of 128 token slots (Mistral)
    assert (engine.stats().async_scheduling.ahead > 100) == async_scheduling
    assert out.token_ids == peft_oracle(model_dir, None, prompt, 210)


def test_released_blocks_serve_prefix_hits_only_while_intact(windowed_model, peft_oracle):
    """A's 120-token prompt leaves its blocks indexed and released (evictable). C1, sharing 100 tokens
    of it, hits them. F's 100 distinct tokens take the never-indexed blocks and then A's oldest: C2
    (A's prompt again) still hits on the blocks its window reads, the evicted ones FREED in its table,
    where the full-chain lookup finds nothing. B's 200 tokens take the rest: C3 hits less. Every
    output is transformers' own, so no hit read KV overwritten since."""
    model_dir, _ = windowed_model("mistral")
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=1, kv_cache_blocks=12, max_model_len=256,
              max_num_batched_tokens=32, kernels="torch")
    engine = llm.engine
    a = random_prompts(1, (120, 120), VOCAB, seed=57)[0]
    f = random_prompts(1, (100, 100), VOCAB, seed=62)[0]
    b = random_prompts(1, (200, 200), VOCAB, seed=58)[0]
    c1 = a[:100] + random_prompts(1, (9, 9), VOCAB, seed=59)[0]
    c2 = a + random_prompts(1, (7, 7), VOCAB, seed=60)[0]
    params = SamplingParams(max_tokens=4, **GREEDY)

    def run(rid: str, prompt: list[int]):
        before = engine.stats().prefix_cache.hit_tokens
        engine.add_request(rid, prompt, params)
        out = drive(engine, window_bound(engine, 20))[rid]
        assert out.token_ids == peft_oracle(model_dir, None, prompt, 4), rid
        return engine.stats().prefix_cache.hit_tokens - before

    def chain_hit(prompt: list[int]) -> int:
        """Blocks a lookup that needs every block from the first would reuse."""
        return len(PrefixCache(engine.blocks).lookup(request(prompt, 10**6)))

    assert run("a", a) == 0
    assert engine.blocks.num_cached_blocks == 7 and engine.blocks.num_used_blocks == 0
    assert run("c1", c1) == 96  # six released, intact blocks of A
    run("f", f)
    assert chain_hit(c2) == 0  # A's first block went to F
    assert run("c2", c2) == 112  # its window reads A's blocks 5 and 6, still intact
    run("b", b)
    assert run("c3", c2) < 112  # A's blocks reused by B are no longer in the index


@pytest.mark.parametrize("name", ("gemma2", "gemma3"))
def test_released_windowed_groups_serve_prefix_hits_only_while_intact(name, windowed_model, peft_oracle):
    """A's 120-token prompt leaves its blocks indexed in every KV layer group, its windowed groups' ones
    released (evictable): A's prompt again hits 112 tokens. F's distinct tokens then take blocks, some of
    A's among them: every output is still transformers' own, so no hit read KV overwritten since (which
    hits the index allows: test_group_blocks)."""
    model_dir, _ = windowed_model(name)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=1, kv_cache_blocks=16, max_model_len=256,
              max_num_batched_tokens=32, kernels="torch")
    engine = llm.engine
    a = random_prompts(1, (120, 120), VOCAB, seed=77)[0]
    f = random_prompts(1, (200, 200), VOCAB, seed=78)[0]
    c = a + random_prompts(1, (7, 7), VOCAB, seed=79)[0]
    params = SamplingParams(max_tokens=4, **GREEDY)

    def run(rid: str, prompt: list[int]) -> int:
        before = engine.stats().prefix_cache.hit_tokens
        engine.add_request(rid, prompt, params)
        out = drive(engine, window_bound(engine, 20))[rid]
        assert out.token_ids == peft_oracle(model_dir, None, prompt, 4), rid
        return engine.stats().prefix_cache.hit_tokens - before

    assert run("a", a) == 0
    assert engine.blocks.num_cached_blocks == 7 * len(GROUPS[name]) and engine.blocks.num_used_blocks == 0
    assert run("c1", c) == 112
    run("f", f)
    run("c2", c)


TRITON_MODELS = ("gemma3", "mistral")


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton needs a GPU or the interpreter")
@pytest.mark.parametrize("name", TRITON_MODELS)
def test_released_blocks_through_the_triton_kernels(name, windowed_model, peft_oracle):
    """The Triton kernels (the interpreter on a CPU) over tables with released blocks (each KV layer
    group's tables for Gemma 3): a prompt of 70 (chunks of 32 whose queries straddle the window), decodes
    past it, beside a DoRA adapter's row."""
    model_dir, adapters = windowed_model(name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(model_dir, device=device, dtype="float32", kernels="triton", max_loras=1, kv_cache_blocks=32,
              max_model_len=128, max_num_batched_tokens=32)
    llm.add_adapter("dora_r16", adapters["dora_r16"])
    names = ["dora_r16", None]
    prompts = random_prompts(2, (60, 70), VOCAB, seed=61)
    engine = llm.engine
    for i, (prompt, adapter) in enumerate(zip(prompts, names)):
        engine.add_request(f"t{i}", prompt, SamplingParams(max_tokens=8, **GREEDY),
                           llm._versions[adapter] if adapter else None)
    final = drive(engine, window_bound(engine, 20))
    assert_matches_peft(llm, model_dir, adapters, prompts, names, [final["t0"], final["t1"]], 8, peft_oracle)


@pytest.mark.parametrize("name", ("gemma2", "mistral"))
def test_forked_choices_release_their_own_references(name, windowed_model, peft_oracle):
    """n = 3 choices fork from a 70-token prompt whose first blocks are already released: each keeps
    the FREED entries, takes a private copy of the shared partial block (in every KV layer group) and
    releases its own references as it decodes; the pool's counts hold throughout."""
    model_dir, _ = windowed_model(name)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=1, kv_cache_blocks=24, max_model_len=256,
              max_num_batched_tokens=32, kernels="torch")
    engine = llm.engine
    prompt = random_prompts(1, (70, 70), VOCAB, seed=63)[0]
    engine.add_request("n3", prompt, SamplingParams(n=3, max_tokens=40, **GREEDY))
    check, choices = window_bound(engine, 20), {}
    while engine.has_unfinished_requests():
        choices |= {o.index: o.token_ids for o in engine.step() if o.finished}
        check(engine)
    assert choices == dict.fromkeys(range(3), peft_oracle(model_dir, None, prompt, 40))
    assert engine.blocks.num_used_blocks == 0
