"""KV layer groups over the paged cache (server.engine.kv_groups, server.engine.group_blocks): Gemma 2
(alternating layers: two groups of two) and Gemma 3 (three windowed layers to one global: four groups of
one) give transformers + peft's greedy tokens and logprobs (float32, 1e-4) through chunked prefill,
preemption, prefix hits, forks and steps scheduled ahead, while each windowed group's table holds only
its window's blocks and the global group's every position."""
from __future__ import annotations

import os

import pytest
import torch

from server.demo import SEVEN, make_adapter, make_base_model
from server.engine import LLM, SamplingParams
from server.engine.block_manager import FREED
from tests.engine_helpers import (
    GREEDY, assert_matches_peft, drive, generate_through_preemption_and_prefix_hits, random_prompts)
from tests.server.engine.test_engine_architectures import reference
from tests.server.engine.test_engine_logprobs import assert_matches
from tests.server.engine.test_engine_prefix_cache import check_blocks

VOCAB = 512
BLOCK = 16
WINDOW = 20  # not a multiple of the block size: the window's edge falls inside a block
SLIDING, FULL = "sliding_attention", "full_attention"
MODELS = {
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, layer_types=[SLIDING, FULL] * 2, attn_logit_softcapping=2.0,
                              final_logit_softcapping=5.0, query_pre_attn_scalar=24)),
    "gemma3": ("gemma3", dict(sliding_window=WINDOW, layer_types=[SLIDING] * 3 + [FULL],
                              final_logit_softcapping=5.0, query_pre_attn_scalar=24)),
}
GROUPS = {"gemma2": (None, WINDOW), "gemma3": (None, WINDOW, WINDOW, WINDOW)}


@pytest.fixture(scope="module")
def grouped_model(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            arch, overrides = MODELS[name]
            root = tmp_path_factory.mktemp(f"groups-{name}")
            model_dir = make_base_model(root / "base", arch, hidden_size=64, num_layers=4, num_heads=4,
                                        num_kv_heads=2, intermediate_size=128, config_overrides=overrides)
            cache[name] = model_dir, {
                "r8_all": make_adapter(model_dir, root / "r8_all", r=8, target_modules=SEVEN, seed=71),
                "r4_qv": make_adapter(model_dir, root / "r4_qv", r=4, lora_alpha=8, use_rslora=True,
                                      target_modules=("q_proj", "v_proj"), seed=72),
                "dora_r16": make_adapter(model_dir, root / "dora_r16", r=16, lora_alpha=16, target_modules=SEVEN,
                                         seed=73, use_dora=True),
            }
        return cache[name]

    return get


def live(table: list[int]) -> int:
    return sum(b != FREED for b in table)


def group_bound(engine):
    """drive(check=...): the pool's invariants; every running sequence's global table holds every position
    it covers, and each windowed one at most the window, the step's chunk and a partial block at each end."""
    budget = engine.config.max_num_batched_tokens

    def check(eng) -> None:
        check_blocks(eng)
        for seq in eng.scheduler.running:
            assert FREED not in seq.block_table
            for table in seq.group_tables:
                assert len(table) == len(seq.block_table)
                assert live(table) <= -(-(WINDOW + budget) // BLOCK) + 1, table

    return check


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_configs_group_their_layers(name, grouped_model):
    from server.engine import ModelConfig

    assert ModelConfig.from_dir(grouped_model(name)[0]).kv_groups.windows == GROUPS[name]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mixed_batch_past_the_window_matches_peft(name, grouped_model, peft_oracle):
    """Prompts of 5 to 90 tokens (3 chunks of 32 for the longest) and 30 decodes, adapters of three ranks
    (one DoRA) beside base rows."""
    model_dir, adapters = grouped_model(name)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=3, kv_cache_blocks=128, max_model_len=256,
              max_num_batched_tokens=32, kernels="torch")
    for adapter, path in adapters.items():
        llm.add_adapter(adapter, path)
    names = ["r8_all", None, "r4_qv", "dora_r16", None, "r8_all"]
    prompts = random_prompts(len(names), (5, 40), VOCAB, seed=74)
    prompts[3] = random_prompts(1, (90, 90), VOCAB, seed=75)[0]
    params = SamplingParams(max_tokens=30, logprobs=3, prompt_logprobs=2, **GREEDY)
    engine = llm.engine
    for i, (prompt, adapter) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}", prompt, params, llm._versions[adapter] if adapter else None)
    final = drive(engine, group_bound(engine))
    outs = [final[f"r{i}"] for i in range(len(prompts))]
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 30, peft_oracle)
    for prompt, adapter, out in zip(prompts, names, outs):
        assert_matches(out, prompt, params, reference(model_dir, adapter and adapters[adapter], prompt + out.token_ids))
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_preemption_and_prefix_hits_match_peft(name, grouped_model, peft_oracle):
    model_dir, dirs = grouped_model(name)
    adapters = {"r8_all": dirs["r8_all"], "r4_qv": dirs["r4_qv"]}
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=2, kv_cache_blocks=18, max_model_len=128,
              kernels="torch")
    for adapter, path in adapters.items():
        llm.add_adapter(adapter, path)
    prompts, names, outs = generate_through_preemption_and_prefix_hits(llm, VOCAB)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 24, peft_oracle)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_long_decode_holds_the_window_in_windowed_groups(name, async_scheduling, grouped_model, peft_oracle):
    """One sequence decoding to 6x the window: each windowed group holds at most the window's blocks and a
    partial one at each end (FREED behind), the global group every block."""
    model_dir, _ = grouped_model(name)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=1, kv_cache_blocks=16, max_model_len=256,
              max_num_batched_tokens=32, kernels="torch", async_scheduling=async_scheduling)
    prompt = random_prompts(1, (30, 30), VOCAB, seed=76)[0]
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(max_tokens=90, **GREEDY))
    most = 0

    def check(eng) -> None:
        nonlocal most
        check_blocks(eng)
        for seq in eng.scheduler.running:
            if seq.num_pending_tokens == 1:  # decoding
                assert live(seq.block_table) == -(-seq.num_computed_tokens // BLOCK) or len(seq.block_table) > 0
                behind = max(0, seq.num_computed_tokens - WINDOW) // BLOCK
                for table in seq.group_tables:
                    most = max(most, live(table))
                    assert table[:behind] == [FREED] * behind

    out = drive(engine, check)["long"]
    assert 0 < most <= -(-WINDOW // BLOCK) + 1
    assert (engine.stats().async_scheduling.ahead > 30) == async_scheduling
    assert out.token_ids == peft_oracle(model_dir, None, prompt, 90)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefix_hits_read_released_windowed_blocks_only_while_intact(name, grouped_model, peft_oracle):
    """A's 120-token prompt leaves its blocks indexed in every group, its windowed groups' ones released
    (evictable): A's prompt again hits 112 tokens. F's distinct tokens then take blocks, A's oldest
    (released) among them: every output is still transformers' own, so no hit read KV overwritten since
    (which hits the index allows: test_group_blocks)."""
    model_dir, _ = grouped_model(name)
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
        out = drive(engine, group_bound(engine))[rid]
        assert out.token_ids == peft_oracle(model_dir, None, prompt, 4), rid
        return engine.stats().prefix_cache.hit_tokens - before

    assert run("a", a) == 0
    groups = len(GROUPS[name])
    assert engine.blocks.num_cached_blocks == 7 * groups and engine.blocks.num_used_blocks == 0
    assert run("c1", c) == 112
    cached = engine.blocks.num_cached_blocks
    run("f", f)
    run("c2", c)
    assert engine.blocks.num_cached_blocks < cached + 10 * groups  # F took some of A's blocks


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forked_choices_copy_every_groups_shared_block(name, grouped_model, peft_oracle):
    """n = 3 choices fork from a 70-token prompt whose windowed groups' first blocks are released: each
    takes a private copy of the shared partial block in every group and releases its own references."""
    model_dir, _ = grouped_model(name)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=1, kv_cache_blocks=24, max_model_len=256,
              max_num_batched_tokens=32, kernels="torch")
    engine = llm.engine
    prompt = random_prompts(1, (70, 70), VOCAB, seed=80)[0]
    engine.add_request("n3", prompt, SamplingParams(n=3, max_tokens=40, **GREEDY))
    check, choices = group_bound(engine), {}
    while engine.has_unfinished_requests():
        choices |= {o.index: o.token_ids for o in engine.step() if o.finished}
        check(engine)
    assert choices == dict.fromkeys(range(3), peft_oracle(model_dir, None, prompt, 40))
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton needs a GPU or the interpreter")
def test_groups_through_the_triton_kernels(grouped_model, peft_oracle):
    """The Triton kernels (the interpreter on a CPU) over each group's tables, released blocks in the
    windowed ones: a prompt of 70 (chunks of 32 straddling the window), decodes past it, beside a DoRA row."""
    model_dir, adapters = grouped_model("gemma3")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(model_dir, device=device, dtype="float32", kernels="triton", max_loras=1, kv_cache_blocks=32,
              max_model_len=128, max_num_batched_tokens=32)
    llm.add_adapter("dora_r16", adapters["dora_r16"])
    names = ["dora_r16", None]
    prompts = random_prompts(2, (60, 70), VOCAB, seed=81)
    engine = llm.engine
    for i, (prompt, adapter) in enumerate(zip(prompts, names)):
        engine.add_request(f"t{i}", prompt, SamplingParams(max_tokens=8, **GREEDY),
                           llm._versions[adapter] if adapter else None)
    final = drive(engine, group_bound(engine))
    assert_matches_peft(llm, model_dir, adapters, prompts, names, [final["t0"], final["t1"]], 8, peft_oracle)
