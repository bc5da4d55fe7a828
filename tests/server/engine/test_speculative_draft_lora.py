"""An adapter's own draft LoRA (speculative method draft_model): its requests draft with it.

With the draft model the target itself and the draft LoRA the adapter itself, a greedy draft for that
adapter's requests is the target's own next token, so every one is accepted: that proves the draft LoRA
is applied to those rows (the same adapter without its draft LoRA has drafts rejected), while the base
rows and another adapter's rows beside them run the base draft, and every output stays the plain
engine's. A draft LoRA that does not fit the draft model, or one given to a server without a draft
model, is refused naming why.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from adapters.draft_lora import ADAPTER_DIR, load_adapter_with_draft
from adapters.format import AdapterFormatError
from server.demo import make_base_model
from server.engine import LLM, SamplingParams
from server.engine.lora.slots import LoraGroupBuffers
from tests.server.engine.test_speculative_draft_model import OPTS, spec
from tests.server.engine.test_speculative_medusa import prompts_of
from tests.server.engine.test_speculative_ngram import assert_same, generate_checked

pytestmark = pytest.mark.unit


def with_draft_dir(adapter: Path, draft: Path, out: Path) -> Path:
    """A copy of `adapter` carrying `draft` as its draft LoRA (its `draft/` folder)."""
    shutil.copytree(adapter, out)
    shutil.copytree(draft, out / ADAPTER_DIR)
    return out


@pytest.fixture(scope="module")
def self_drafted(tiny_adapters, tmp_path_factory) -> Path:
    """r8_all whose draft LoRA is r8_all itself (for the tiny model drafting for itself)."""
    return with_draft_dir(tiny_adapters["r8_all"], tiny_adapters["r8_all"], tmp_path_factory.mktemp("sd") / "r8_all")


def record_drafts(engine) -> list[tuple]:
    """Every proposal `engine`'s draft model makes: (sequence, the position its drafts start at, the drafts)."""
    proposer = engine.scheduler.draft_model
    seen, propose = [], proposer.propose

    def recording(requests):
        drafts = propose(requests)
        seen.extend((r.seq, len(r.seq.token_ids), d) for r, d in zip(requests, drafts))
        return drafts

    proposer.propose = recording
    return seen


def rejected(seen: list[tuple], version: str | None) -> int:
    """Proposals for `version`'s sequences whose drafts are not the tokens the sequence went on with."""
    bad = 0
    for seq, at, drafts in seen:
        if seq.version_id == version:
            after = seq.token_ids[at: at + len(drafts)]
            bad += after != drafts[: len(after)]
    return bad


def run_mixed(tiny_model_dir, tiny_adapters, r8: Path) -> tuple[list, LLM, list[tuple]]:
    """A greedy mixed batch (base, r8_all from `r8`, r4_qv) on a server whose draft model is the target."""
    llm = LLM(tiny_model_dir, speculative_config=spec(tiny_model_dir), **OPTS)
    llm.add_adapter("r8_all", r8)
    llm.add_adapter("r4_qv", tiny_adapters["r4_qv"])
    seen = record_drafts(llm.engine)
    prompts = prompts_of(9, seed=11)
    names = [None, "r8_all", "r4_qv"] * 3
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    return generate_checked(llm, prompts, params, names), llm, seen


def test_draft_lora_equal_to_the_adapter_has_every_greedy_draft_accepted(tiny_model_dir, tiny_adapters,
                                                                           self_drafted):
    outs, llm, seen = run_mixed(tiny_model_dir, tiny_adapters, self_drafted)
    r8 = llm._versions["r8_all"]
    assert sum(1 for s, _, _ in seen if s.version_id == r8) >= 9, "r8_all's requests were drafted for"
    assert rejected(seen, r8) == 0, "a draft of the adapter's own draft LoRA was rejected"
    assert rejected(seen, None) == 0, "the base rows draft with the base draft model (the target itself)"
    assert rejected(seen, llm._versions["r4_qv"]) > 0, "r4_qv has no draft LoRA: the base draft misses"
    plain = LLM(tiny_model_dir, **OPTS)
    plain.add_adapter("r8_all", tiny_adapters["r8_all"])
    plain.add_adapter("r4_qv", tiny_adapters["r4_qv"])
    prompts = prompts_of(9, seed=11)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    assert_same(generate_checked(plain, prompts, params, [None, "r8_all", "r4_qv"] * 3), outs)
    # Without its draft LoRA, the same adapter's drafts are rejected: the draft LoRA was what made them right.
    _, bare, bare_seen = run_mixed(tiny_model_dir, tiny_adapters, tiny_adapters["r8_all"])
    assert rejected(bare_seen, bare._versions["r8_all"]) > 0


def ab_storages(layers: list[dict]) -> list[int]:
    """Bytes each A and B tensor of `layers`' LoRA groups holds in its storage (a stand-in: one element's)."""
    return [t.untyped_storage().nbytes() for groups in layers for g in groups.values() for t in (g.a, *g.b)]


def test_draft_slots_hold_no_memory_until_a_draft_lora_loads(tiny_model_dir, tiny_adapters, self_drafted):
    llm = LLM(tiny_model_dir, speculative_config=spec(tiny_model_dir), **OPTS)
    llm.add_adapter("r4_qv", tiny_adapters["r4_qv"])
    engine = llm.engine
    draft = engine.lora_slots.draft
    prompts = prompts_of(6, seed=5)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(prompts)
    without = generate_checked(llm, prompts, params, [None, "r4_qv"] * 3)
    assert engine.stats().slots.draft_bytes == 0, "no adapter has a draft LoRA: the draft slots hold nothing"
    assert set(ab_storages(draft.layers)) == {4}, "A and B are float32 stand-ins of one element"
    llm.add_adapter("r8_all", self_drafted)
    names = [None, "r8_all", "r4_qv"] * 2
    mixed = generate_checked(llm, prompts, params, names)
    # Allocated at the first draft LoRA: as many bytes as the target's slots (the draft is the same model).
    target = sum(t.numel() * t.element_size() for groups in engine.lora_slots.layers for g in groups.values()
                 for t in (g.a, *g.b))
    assert engine.stats().slots.draft_bytes == target == sum(ab_storages(draft.layers))
    plain = LLM(tiny_model_dir, **OPTS)
    plain.add_adapter("r8_all", tiny_adapters["r8_all"])
    plain.add_adapter("r4_qv", tiny_adapters["r4_qv"])
    assert_same(generate_checked(plain, prompts, params, [None, "r4_qv"] * 3), without)
    assert_same(generate_checked(plain, prompts, params, names), mixed)


def test_without_memory_for_the_draft_slots_draft_loras_stay_off_and_outputs_do_not_change(
        tiny_model_dir, tiny_adapters, self_drafted, monkeypatch, caplog):
    llm = LLM(tiny_model_dir, speculative_config=spec(tiny_model_dir), **OPTS)
    llm.add_adapter("r8_all", self_drafted)
    draft = llm.engine.lora_slots.draft
    real_repage = LoraGroupBuffers.repage

    def out_of_memory(self, pages, zeros):
        if zeros is torch.zeros:
            raise torch.OutOfMemoryError("no room for the draft slots")
        real_repage(self, pages, zeros)

    monkeypatch.setattr(LoraGroupBuffers, "repage", out_of_memory)
    seen = record_drafts(llm.engine)
    prompts = prompts_of(3, seed=7)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(prompts)
    outs = generate_checked(llm, prompts, params, [None, "r8_all", None])
    assert "draft LoRAs are not used" in caplog.text
    assert llm.engine.stats().slots.draft_bytes == 0 and not any(draft.has)
    assert set(ab_storages(draft.layers)) == {4}, "stand-ins again"
    assert rejected(seen, llm._versions["r8_all"]) > 0, "its rows draft with the base draft model"
    plain = LLM(tiny_model_dir, **OPTS)
    plain.add_adapter("r8_all", tiny_adapters["r8_all"])
    assert_same(generate_checked(plain, prompts, params, [None, "r8_all", None]), outs)


def test_draft_lora_bytes_count_in_size_bytes(tiny_model_dir, tiny_adapters, self_drafted):
    llm = LLM(tiny_model_dir, speculative_config=spec(tiny_model_dir), **OPTS)
    shape, rank = llm.engine.adapter_shape, llm.engine.config.lora.max_lora_rank
    alone = load_adapter_with_draft(tiny_adapters["r8_all"], shape, llm.engine.draft_adapter_shape, rank)
    drafted = load_adapter_with_draft(self_drafted, shape, llm.engine.draft_adapter_shape, rank)
    assert drafted.draft is not None and drafted.size_bytes == 2 * alone.size_bytes


def test_refused_without_a_draft_model(tiny_model_dir, self_drafted):
    llm = LLM(tiny_model_dir, **OPTS)
    with pytest.raises(AdapterFormatError, match="runs no draft model"):
        llm.add_adapter("r8_all", self_drafted)


def test_a_draft_lora_that_does_not_fit_the_draft_model_is_refused(tiny_model_dir, tiny_adapters, tmp_path):
    small = make_base_model(tmp_path / "small", "llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, seed=7)
    misfit = with_draft_dir(tiny_adapters["r8_all"], tiny_adapters["r8_all"], tmp_path / "misfit")
    llm = LLM(tiny_model_dir, speculative_config=spec(small), **OPTS)
    with pytest.raises(AdapterFormatError, match=r"draft/ folder: .*(shape|layer)"):
        llm.add_adapter("r8_all", misfit)


def test_a_dora_draft_lora_is_refused(tiny_model_dir, tiny_adapters, tiny_dora_adapters, tmp_path):
    dora = with_draft_dir(tiny_adapters["r8_all"], next(iter(tiny_dora_adapters.values())), tmp_path / "dora")
    llm = LLM(tiny_model_dir, speculative_config=spec(tiny_model_dir), **OPTS)
    with pytest.raises(AdapterFormatError, match="use_dora is not supported"):
        llm.add_adapter("r8_all", dora)
