"""Activated LoRA (PEFT's alora_invocation_tokens) in the engine: exact against transformers + peft.

The adapter applies from the start of the last occurrence of its invocation
sequence in the prompt; before it (and throughout, when the prompt lacks it)
tokens run as the base model, in the same batch as base and plain LoRA rows,
on the torch and the Triton path (the interpreter on CPU), with chunked
prefill splitting at the activation point, with and without the prefix cache,
through preemption and forks. The prefix cache serves an aLoRA's blocks
before the activation point from, and to, the base model and other aLoRAs of
the same tenant, and never an adapter's blocks to anyone else.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from adapters.activation import NOT_INVOKED, activation_start
from adapters.format import AdapterFormatError, ModelShape, load_adapter_dir
from server.engine import LLM, SamplingParams
from tests.engine_helpers import drive, greedy
from tests.hostile_helpers import tampered_adapter

VOCAB = 512
BLOCK = 16
TOL = 1e-4
INV_A = [7, 8, 9]
INV_B = [5, 5]  # overlapping occurrences: "5 5 5" holds it at two starts, PEFT takes the last
INVOCATIONS = {"alora_a": INV_A, "alora_b": INV_B}


def words(n: int, seed: int) -> list[int]:
    """n token ids that hold no invocation token (ids 10..), so where an invocation is is known."""
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_adapters, tmp_path_factory) -> dict:
    """Two aLoRAs (the weights of r8_all and r16_rslora, with invocation sequences) and a plain LoRA."""
    root = tmp_path_factory.mktemp("alora")
    return {
        "alora_a": tampered_adapter(tiny_adapters["r8_all"], root / "a", config={"alora_invocation_tokens": INV_A}),
        "alora_b": tampered_adapter(tiny_adapters["r16_rslora"], root / "b",
                                    config={"alora_invocation_tokens": INV_B}),
        "r4_qv": tiny_adapters["r4_qv"],
    }


def make_llm(model_dir, dirs, cache=True, **kw) -> LLM:
    opts = dict(device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=96, max_model_len=256,
                max_num_batched_tokens=24, block_size=BLOCK, kernels="torch")
    llm = LLM(model_dir, **{**opts, **kw})
    llm.engine.set_prefix_cache_policy(cache)
    for name, path in dirs.items():
        llm.add_adapter(name, path)
    return llm


# (adapter, prompt): the activation point falls mid-chunk (chunks of 24 tokens), at the start, at the
# end, after a repeat, inside an overlapping run; absent, and half present at the end.
CASES = {
    "present": ("alora_a", words(37, 1) + INV_A + words(6, 2)),
    "absent": ("alora_a", words(30, 3)),
    "repeated": ("alora_a", words(5, 4) + INV_A + words(20, 5) + INV_A + words(9, 6)),
    "at_start": ("alora_a", INV_A + words(20, 7)),
    "at_end": ("alora_a", words(50, 8) + INV_A),
    "partial_at_end": ("alora_a", words(20, 9) + INV_A[:2]),
    "overlapping": ("alora_b", words(20, 10) + [5, 5, 5] + words(4, 11)),
    "b_absent_a_present": ("alora_b", words(12, 12) + INV_A + words(12, 13)),
    "base": (None, words(37, 1) + INV_A + words(6, 2)),
    "plain_lora": ("r4_qv", words(37, 1) + INV_A + words(6, 2)),
}


def test_activation_point_is_peft_s(adapter_dirs):
    """adapters.activation against PEFT's own calculate_alora_offsets, on prompts dense in invocations."""
    from peft import LoraConfig
    from peft.tuners.lora.variants import calculate_alora_offsets

    rng = random.Random(3)
    # 0 and 256 make byte patterns that match across token boundaries (activation_start searches bytes).
    for invocation in ([7], [7, 8], [5, 5], [5, 5, 5], [7, 8, 7], [0, 0], [256, 0], [0, 1]):
        config = {"x": LoraConfig(alora_invocation_tokens=invocation, task_type="CAUSAL_LM")}
        for _ in range(300):
            prompt = [rng.choice((0, 1, 5, 7, 8, 256)) for _ in range(rng.randint(1, 12))]
            (offset,) = calculate_alora_offsets(config, "x", torch.tensor([prompt]))
            start = activation_start(invocation, prompt)
            assert start == (NOT_INVOKED if offset is None else len(prompt) - offset), (invocation, prompt)


def alora_start(name: str | None, prompt: list[int]) -> int | None:
    """Where `name` (an aLoRA) starts applying on `prompt` (None: nowhere; checked against PEFT above)."""
    if name not in INVOCATIONS:
        return None
    start = activation_start(INVOCATIONS[name], prompt)
    return None if start == NOT_INVOKED else start


@pytest.fixture(scope="module")
def peft_logprobs(tiny_model_dir, adapter_dirs):
    """peft_logprobs(name, ids, start) -> [len(ids), V]: log_softmax of transformers + peft logits with the
    aLoRA applied from `start` on (None: nowhere), as PEFT's generate applies it for that prompt."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models: dict = {}

    @torch.inference_mode()
    def get(name: str | None, ids: list[int], start: int | None) -> torch.Tensor:
        if name not in models:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
            if name is not None:
                model = PeftModel.from_pretrained(model, adapter_dirs[name])
            models[name] = model.eval()
        kwargs = {}
        if name in INVOCATIONS:
            # Explicit: PEFT would search prompt + output, where the output could hold the invocation.
            kwargs["alora_offsets"] = [None if start is None else len(ids) - start]
        logits = models[name](input_ids=torch.tensor([ids]), **kwargs).logits[0].float()  # [L, V]
        return torch.log_softmax(logits, dim=-1)

    return get


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapter_dirs, peft_oracle) -> dict:
    return {case: peft_oracle(tiny_model_dir, adapter_dirs[name] if name else None, prompt, 6)
            for case, (name, prompt) in CASES.items()}


def run_cases(llm: LLM, tag: str, params: SamplingParams, cases=tuple(CASES)) -> dict:
    for case in cases:
        name, prompt = CASES[case]
        llm.engine.add_request(f"{tag}-{case}", prompt, params, llm._versions[name] if name else None)
    final = drive(llm.engine)
    return {case: final[f"{tag}-{case}"] for case in cases}


def assert_logprobs(out, name, prompt, peft_logprobs) -> None:
    ref = peft_logprobs(name, prompt + out.token_ids, alora_start(name, prompt))  # [P + N, V]
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry.token_id == token
        assert abs(entry.logprob - float(ref[len(prompt) - 1 + i, token])) <= TOL


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_mixed_batch_matches_peft_torch(tiny_model_dir, adapter_dirs, expected, peft_logprobs, cache):
    llm = make_llm(tiny_model_dir, adapter_dirs, cache=cache)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    # Twice: with the cache on, the second pass starts every prompt from cached blocks.
    for tag in ("first", "again"):
        outs = run_cases(llm, tag, params)
        for case, (name, prompt) in CASES.items():
            assert outs[case].token_ids == expected[case], (tag, case)
            assert_logprobs(outs[case], name, prompt, peft_logprobs)
    stats = llm.engine.stats()
    assert (stats.prefix_cache.hit_tokens > 0) == cache
    assert stats.kv_blocks.used == 0
    # The aLoRA's rule is not plain LoRA's and not the base model's: the same prompt gives three answers.
    assert len({tuple(expected[c]) for c in ("present", "base", "plain_lora")}) == 3
    assert expected["absent"] == llm.generate([CASES["absent"][1]], greedy(6))[0].token_ids


def test_adapter_memory_paged_by_rank_matches_peft(tiny_model_dir, adapter_dirs, expected, peft_logprobs):
    """--lora-page-rows: the activation point is per adapter entry, A and B come through the page table."""
    llm = make_llm(tiny_model_dir, adapter_dirs, lora_page_rows=8)
    assert llm.engine.lora_slots.paging.paged
    outs = run_cases(llm, "paged", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1))
    for case, (name, prompt) in CASES.items():
        assert outs[case].token_ids == expected[case], case
        assert_logprobs(outs[case], name, prompt, peft_logprobs)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton needs a GPU or the interpreter")
def test_mixed_batch_matches_peft_triton(tiny_model_dir, adapter_dirs, expected):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = make_llm(tiny_model_dir, adapter_dirs, device=device, kernels="triton", kv_cache_blocks=64,
                   max_model_len=128)
    assert llm.engine.kernels.name == "triton"
    # The interpreter is slow: one batch of the cases that set the kernels different work lists.
    cases = ("present", "absent", "repeated", "overlapping", "base", "plain_lora")
    outs = run_cases(llm, "t", greedy(6), cases)
    assert {case: out.token_ids for case, out in outs.items()} == {case: expected[case] for case in cases}


def test_prompt_logprobs_are_the_base_models_before_the_point(tiny_model_dir, adapter_dirs, peft_logprobs):
    llm = make_llm(tiny_model_dir, adapter_dirs)
    name, prompt = CASES["present"]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([prompt], params, adapters=[name])[0]
    ref = peft_logprobs(name, prompt, alora_start(name, prompt))
    base = peft_logprobs(None, prompt, None)
    for j in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[j].logprob - float(ref[j - 1, prompt[j]])) <= TOL, j
    start = prompt.index(INV_A[0])
    assert torch.allclose(ref[:start], base[:start], atol=TOL) and not torch.allclose(ref, base, atol=TOL)


def test_preemption_mid_decode_and_forks_match_peft(tiny_model_dir, adapter_dirs, peft_oracle, peft_logprobs):
    # 12 blocks of 16 tokens for six requests of ~45 + 30 tokens: sequences are preempted while
    # decoding and recomputed from their tokens, the activation point kept.
    llm = make_llm(tiny_model_dir, adapter_dirs, kv_cache_blocks=12, max_model_len=128)
    cases = ["present", "repeated", "base", "overlapping", "plain_lora", "at_end"]
    scheduler = llm.engine.scheduler
    preempt = scheduler._preempt
    mid_decode: list[int] = []

    def recording(seq, batch):
        if seq.num_output_tokens > 0:
            mid_decode.append(seq.num_output_tokens)
        preempt(seq, batch)

    scheduler._preempt = recording
    for case in cases:
        name, prompt = CASES[case]
        llm.engine.add_request(case, prompt, greedy(30), llm._versions[name] if name else None)
    final = drive(llm.engine)
    assert mid_decode
    for case in cases:
        name, prompt = CASES[case]
        assert final[case].token_ids == peft_oracle(tiny_model_dir, adapter_dirs[name] if name else None,
                                                    prompt, 30), case
    # n > 1: the forked choices share the prompt's blocks and its activation point.
    name, prompt = CASES["repeated"]
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params, adapters=[name])[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for choice in out.outputs:
        assert_logprobs(choice, name, prompt, peft_logprobs)
    assert llm.engine.stats().kv_blocks.used == 0


def test_prefix_cache_shares_blocks_before_the_point_only(tiny_model_dir, adapter_dirs, peft_oracle):
    # 100 tokens, both invocations at token 64: blocks 0-3 are the base model's for either aLoRA,
    # blocks 4-5 (full) are each adapter's own.
    prompt = words(64, 20) + INV_A + INV_B + words(31, 21)
    llm = make_llm(tiny_model_dir, adapter_dirs, max_num_batched_tokens=128)
    engine = llm.engine
    blocks = engine.blocks

    def send(rid, name, tenant="t1", salt=None):
        before = engine.stats().prefix_cache.hit_tokens
        engine.add_request(rid, prompt, greedy(4), llm._versions[name] if name else None, tenant=tenant,
                           cache_salt=salt)
        out = drive(engine)[rid]
        assert out.token_ids == peft_oracle(tiny_model_dir, adapter_dirs[name] if name else None, prompt, 4)
        return engine.stats().prefix_cache.hit_tokens - before

    assert send("a", "alora_a") == 0
    # a's blocks before the point are indexed as base-model KV (no version), its own two on its version.
    assert len(blocks.by_version[llm._versions["alora_a"]]) == 2
    assert sum(version is None for _, version in blocks.entries.values()) == 4
    assert send("b", "alora_b") == 64  # the second aLoRA prefills the shared part once: 4 blocks hit
    assert send("base", None) == 64  # the base model reuses them too; never the adapters' blocks 4-5
    assert send("a2", "alora_a") == 96  # the same aLoRA again: its own blocks as well
    assert send("plain", "r4_qv") == 0  # a plain LoRA applies from token 0: nothing is the base's
    assert send("other-tenant", "alora_b", tenant="t2") == 0  # still per tenant
    assert send("salted", "alora_b", salt="s") == 0
    # Deleting an aLoRA drops its own blocks; the base model's it computed stay for everyone else.
    version_a = llm._versions["alora_a"]
    llm.remove_adapter("alora_a")
    assert version_a not in blocks.by_version
    assert send("base-after", None) == 96
    assert engine.stats().kv_blocks.used == 0


def test_two_aloras_with_their_points_elsewhere_share_nothing_past_either(tiny_model_dir, adapter_dirs,
                                                                           peft_oracle):
    # Same prompt, points in different blocks: alora_b applies from token 20, alora_a from 70. The
    # base model's blocks are those before the earlier point, for both.
    prompt = words(20, 30) + INV_B + words(48, 31) + INV_A + words(20, 32)
    llm = make_llm(tiny_model_dir, adapter_dirs, max_num_batched_tokens=128)
    engine = llm.engine
    for rid, name, hits in (("a", "alora_a", 0), ("b", "alora_b", 16), ("a2", "alora_a", 80)):
        before = engine.stats().prefix_cache.hit_tokens
        engine.add_request(rid, prompt, greedy(4), llm._versions[name])
        out = drive(engine)[rid]
        assert out.token_ids == peft_oracle(tiny_model_dir, adapter_dirs[name], prompt, 4)
        assert engine.stats().prefix_cache.hit_tokens - before == hits, rid


def test_same_blocks_with_the_point_elsewhere_are_not_shared(tiny_model_dir, adapter_dirs, peft_oracle):
    # The first 32 tokens are the same, but in `straddle` the last invocation starts at 30 and runs
    # into the next block, while in `inside` it is the one at 20: block 1 holds the same tokens with
    # the adapter switched on at different positions, so different K/V, and only block 0 is shared.
    head = words(20, 40) + INV_A + words(7, 41) + INV_A[:2]
    straddle = head + INV_A[2:] + words(20, 42)
    inside = head + words(21, 43)
    llm = make_llm(tiny_model_dir, adapter_dirs, max_num_batched_tokens=128)
    engine = llm.engine
    for rid, prompt, hits in (("straddle", straddle, 0), ("inside", inside, 16)):
        before = engine.stats().prefix_cache.hit_tokens
        engine.add_request(rid, prompt, greedy(4), llm._versions["alora_a"])
        out = drive(engine)[rid]
        assert out.token_ids == peft_oracle(tiny_model_dir, adapter_dirs["alora_a"], prompt, 4), rid
        assert engine.stats().prefix_cache.hit_tokens - before == hits, rid


@pytest.mark.parametrize("extra, why", [({"use_dora": True}, "use_dora"), ({"init_lora_weights": "mica"}, "mica")])
def test_combinations_peft_has_no_variant_for_are_refused(tiny_model_dir, adapter_dirs, tmp_path, extra, why):
    bad = tampered_adapter(adapter_dirs["alora_a"], tmp_path / "bad", config=extra)
    with pytest.raises(AdapterFormatError, match=why):
        load_adapter_dir(bad, ModelShape.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text())),
                         max_lora_rank=32)


def test_shared_base_blocks_follow_the_operators_policy(tiny_model_dir, adapter_dirs, peft_oracle):
    # With --share-base-prefix-cache, an aLoRA's blocks before its point are base-model blocks like
    # any other: another tenant's base request reuses them; its adapter blocks stay its own.
    prompt = words(64, 60) + INV_A + words(29, 61)
    llm = make_llm(tiny_model_dir, adapter_dirs, max_num_batched_tokens=128)
    engine = llm.engine
    engine.set_prefix_cache_policy(True, share_base_across_tenants=True)
    for rid, name, tenant, hits in (("a", "alora_a", "t1", 0), ("base", None, "t2", 64), ("a-t2", "alora_a", "t2", 64)):
        before = engine.stats().prefix_cache.hit_tokens
        engine.add_request(rid, prompt, greedy(4), llm._versions[name] if name else None, tenant=tenant)
        out = drive(engine)[rid]
        assert out.token_ids == peft_oracle(tiny_model_dir, adapter_dirs[name] if name else None, prompt, 4), rid
        assert engine.stats().prefix_cache.hit_tokens - before == hits, rid
        # cached_tokens reports only what the caller's own tenant sent before.
        assert out.num_cached_tokens == (64 if rid == "a-t2" else 0), rid
