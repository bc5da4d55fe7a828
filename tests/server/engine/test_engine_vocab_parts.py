"""LoRA on embed_tokens and lm_head, and modules_to_save copies of them, per request in mixed batches: greedy
tokens equal transformers + peft's and logprobs are within 1e-4, on an untied and a tied base, while base
rows and plain adapters in the same batch are unaffected."""
from __future__ import annotations

import pytest
import torch

from server.demo import make_base_model
from server.engine import LLM, SamplingParams
from tests.fixtures_architectures import ARCH_MODELS
from tests.engine_helpers import assert_matches_peft, generate_in_one_batch, greedy, random_prompts
from tests.server.engine.test_engine_logprobs import assert_matches
from tests.vocab_adapters import make_vocab_adapter

pytestmark = pytest.mark.unit

VOCAB = 512
# name -> make_vocab_adapter kwargs
UNTIED = {
    "embed_head_lora": dict(target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"], seed=1),
    "saved": dict(target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"], seed=2),
    "head_only": dict(target_modules=["lm_head"], r=8, lora_alpha=8, seed=3),
    "attn": dict(target_modules=["q_proj", "v_proj"], seed=4),
}
TIED = {
    "embed_lora": dict(target_modules=["embed_tokens", "q_proj"], seed=5),
    "saved_embed": dict(target_modules=["v_proj"], modules_to_save=["embed_tokens"], seed=6),
    "head_lora": dict(target_modules=["lm_head"], seed=7),
    "saved_head": dict(target_modules=["q_proj"], modules_to_save=["lm_head"], seed=8),
}


def _adapters(model_dir, root, specs) -> dict:
    return {name: make_vocab_adapter(model_dir, root / name, **kw) for name, kw in specs.items()}


@pytest.fixture(scope="module", params=["untied", "tied"])
def served(request, tmp_path_factory, tiny_model_dir, model_variant_dir):
    tied = request.param == "tied"
    model_dir = model_variant_dir(tie=True) if tied else tiny_model_dir
    adapters = _adapters(model_dir, tmp_path_factory.mktemp(f"vocab-{request.param}"), TIED if tied else UNTIED)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=256, max_model_len=512,
              max_num_batched_tokens=256)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return model_dir, adapters, llm


def _peft_logprobs(model_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.inference_mode():
        logits = model.eval()(input_ids=torch.tensor([ids])).logits[0].float()  # [L, V]
    return torch.log_softmax(logits, dim=-1)


def test_mixed_batch_greedy_matches_peft(served, peft_oracle):
    model_dir, adapters, llm = served
    names = [None, *adapters] * 3
    prompts = random_prompts(len(names), (3, 16), VOCAB, seed=11)
    outs = generate_in_one_batch(llm, prompts, names, greedy(8))
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 8, peft_oracle)
    for name in adapters:  # each adapter changes what it generates
        runs = [(p, o) for p, n, o in zip(prompts, names, outs) if n == name]
        assert any(o.token_ids != peft_oracle(model_dir, None, p, 8) for p, o in runs), name
    assert llm.engine.stats().kv_blocks.used == 0


def test_logprobs_and_prompt_logprobs_match_peft_through_chunks(served):
    model_dir, adapters, llm = served
    names = [*adapters, None]
    prompts = random_prompts(len(names), (5, 30), VOCAB, seed=12)
    prompts[0] = random_prompts(1, (300, 300), VOCAB, seed=13)[0]  # 300 tokens > the 256-token budget: 2 chunks
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = llm.generate(prompts, params, adapters=names)
    for prompt, name, out in zip(prompts, names, outs):
        ref = _peft_logprobs(model_dir, adapters.get(name), prompt + out.token_ids)
        assert_matches(out, prompt, params, ref)


def test_parts_leave_with_their_slot(served):
    """Four adapters through two slots: each is evicted and reloaded, its parts with it."""
    model_dir, adapters, _ = served
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=2, kv_cache_blocks=64, max_model_len=128)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    parts, slots = llm.engine.model.vocab_parts, llm.engine.lora_slots
    prompts = random_prompts(1, (10, 10), VOCAB, seed=14)
    first = {name: llm.generate(prompts, greedy(4), adapters=[name])[0].token_ids for name in adapters}
    again = {name: llm.generate(prompts, greedy(4), adapters=[name])[0].token_ids for name in reversed(adapters)}
    assert first == again and slots.evictions >= 4
    with_parts = {slots.slot_of[llm._versions[n]] for n in adapters if llm._versions[n] in slots.slot_of
                  and n != "attn"}
    assert set(parts.parts) == with_parts
    assert parts.slot_has == [s in parts.parts for s in range(2)]


def test_copies_of_the_base_are_not_kept(served):
    """PEFT saves the base's embedding and lm_head beside a LoRA on them: the host tier drops them (and their
    bytes), while modules_to_save copies, which differ, stay."""
    model_dir, adapters, llm = served
    specs = {**UNTIED, **TIED}
    for name in adapters:
        held = llm.engine.host.get(llm._versions[name])
        saved = specs[name].get("modules_to_save") or []
        vocab = held.vocab.tensors() if held.vocab is not None else []
        assert [t.shape for t in vocab if t.shape == (512, 64)] == [(512, 64)] * len(saved), name
        assert held.size_bytes == sum(t.nbytes for t in [*held.tensors(), *vocab]), name


def test_padded_decode_leaves_steps_with_parts_unpadded(served, peft_oracle):
    """Decode steps padded to a bucket (CUDA graphs on a GPU) serve the slots as a bound, not the data:
    a step with rows of an adapter with parts runs unpadded, one without them still padded."""
    model_dir, adapters, _ = served
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=128, max_model_len=128,
              max_num_seqs=8, kernels="torch")
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    cfg = llm.engine.config
    padded = llm.engine.runner.use_padded_decode(cfg.lora.max_loras, cfg.scheduler.max_num_seqs,
                                                 cfg.scheduler.max_model_len)
    runs = []
    run = padded.run
    padded.run = lambda key: runs.append(key) or run(key)
    llm.generate(random_prompts(2, (5, 12), VOCAB, seed=15), greedy(4), adapters=[None, None])
    assert len(runs) == 3  # the decode steps after the prefill
    names = [None, *adapters]
    prompts = random_prompts(len(names), (5, 12), VOCAB, seed=16)
    outs = llm.generate(prompts, greedy(6), adapters=names)
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 6, peft_oracle)
    assert len(runs) == 3


def test_gemma_scales_the_embedding_lora_and_caps_after_the_lm_head(tmp_path, peft_oracle):
    """Gemma: PEFT scales an embedding LoRA's delta by sqrt(hidden) as the embedding itself, and the
    final soft-capping comes after the lm_head's LoRA."""
    arch, overrides, _ = ARCH_MODELS["gemma2"]
    model_dir = make_base_model(tmp_path / "gemma", arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=128, config_overrides=overrides)
    adapters = _adapters(model_dir, tmp_path, {
        "lora": dict(target_modules=["embed_tokens", "lm_head", "q_proj"], seed=9),
        "saved": dict(target_modules=["v_proj"], modules_to_save=["embed_tokens"], seed=10)})
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=2, kv_cache_blocks=64, max_model_len=128)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    names = [None, "lora", "saved"] * 2
    prompts = random_prompts(len(names), (3, 16), VOCAB, seed=17)
    outs = generate_in_one_batch(llm, prompts, names, greedy(6))
    assert_matches_peft(llm, model_dir, adapters, prompts, names, outs, 6, peft_oracle)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    out = llm.generate([prompts[1]], params, adapters=["lora"])[0]
    assert_matches(out, prompts[1], params, _peft_logprobs(model_dir, adapters["lora"], prompts[1] + out.token_ids))


def test_an_lm_head_only_adapter_takes_a_slot_of_rank_zero(served):
    """No projection to compute for it: its slot's rank is 0, so the LoRA kernels skip its rows."""
    _, adapters, llm = served
    name = "head_only" if "head_only" in adapters else "head_lora"
    llm.generate(random_prompts(1, (5, 5), VOCAB, seed=18), greedy(2), adapters=[name])
    slots = llm.engine.lora_slots
    assert slots.slot_ranks[slots.slot_of[llm._versions[name]]] == 0
