"""DoRA adapters served in the same batches as plain LoRA adapters and base rows: greedy tokens and
logprobs equal transformers + peft's (float32, 1e-4), through chunked prefill, preemption, forks,
paging through two slots, padded decode, the Triton kernels, and a base model with biases; and their
scales kept in a real Redis per version and base, read back at a reload instead of computed, and
computed when a version is accepted, so that its first load is a reload."""
from __future__ import annotations

import json
import os
import shutil

from types import SimpleNamespace

import pytest
import safetensors.torch
import torch

from adapters.dora_scale_store import MAX_BASES, DoraScaleStore
from adapters.format import ModelShape, inspect_adapter_bytes, load_adapter_bytes
from adapters.host_tier import HostTier
from adapters.registry import AdapterRegistry
from server.demo import make_adapter
from server.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from server.engine.lora import dora_precompute, dora_scale_cache
from tests.engine_helpers import drive, random_prompts
from tests.fixtures_models import TINY_DORA_ADAPTERS
from tests.server.engine.test_engine_logprobs import assert_matches

VOCAB = 512
DORA = tuple(TINY_DORA_ADAPTERS)
LORA = ("r8_all", "r4_qv")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_adapters, tiny_dora_adapters):
    return {**tiny_adapters, **tiny_dora_adapters}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapter_dirs):
    """reference(name_or_None, ids, model_dir=tiny) -> [len(ids), V]: log_softmax of transformers (+ peft)
    float32 logits at every position."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models: dict = {}

    @torch.inference_mode()
    def get(name, ids, model_dir=tiny_model_dir, dirs=adapter_dirs):
        key = (str(model_dir), name and str(dirs[name]))
        if key not in models:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            if name is not None:
                model = PeftModel.from_pretrained(model, dirs[name])
            models[key] = model.eval()
        return torch.log_softmax(models[key](input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)

    return get


def make_llm(model_dir, adapter_dirs, names, **kw) -> LLM:
    opts = dict(device="cpu", dtype="float32", max_loras=8, kv_cache_blocks=256, max_model_len=256,
                max_num_batched_tokens=64, block_size=16)
    llm = LLM(model_dir, **{**opts, **kw})
    for name in names:
        llm.add_adapter(name, adapter_dirs[name])
    return llm


def params(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2, **kw)


def check(outs, prompts, names, p, reference) -> None:
    for prompt, name, out in zip(prompts, names, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == p.max_tokens
        assert_matches(out, prompt, p, reference(name, prompt + out.token_ids))


def test_64_requests_mixing_base_lora_and_dora_match_peft(tiny_model_dir, adapter_dirs, reference):
    """q/v-only, all seven projections, rsLoRA and rank/alpha patterns, each in the batch with plain
    LoRA adapters and base rows; prompts long enough to be prefilled in chunks beside decodes."""
    llm = make_llm(tiny_model_dir, adapter_dirs, (*LORA, *DORA))
    kinds = [None, *LORA, *DORA]
    names = [kinds[i % len(kinds)] for i in range(64)]
    prompts = random_prompts(64, (3, 70), VOCAB, seed=81)
    p = params(6, prompt_logprobs=1)
    engine = llm.engine
    steps_with_dora = []
    step = engine.step

    def recording():
        out = step()
        steps_with_dora.append(any(engine.lora_slots.slot_dora))
        return out

    engine.step = recording
    outs = llm.generate(prompts, p, adapters=names)
    check(outs, prompts, names, p, reference)
    assert any(steps_with_dora)
    assert engine.stats().kv_blocks.used == 0


def test_the_magnitude_vectors_change_the_output(tiny_model_dir, adapter_dirs, tmp_path):
    """The same A and B served as plain LoRA give other logprobs: the DoRA scales are applied."""
    plain = tmp_path / "plain"
    shutil.copytree(adapter_dirs["dora_r8_all"], plain)
    cfg = json.loads((plain / "adapter_config.json").read_text())
    (plain / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": False}))
    tensors = safetensors.torch.load_file(plain / "adapter_model.safetensors")
    safetensors.torch.save_file({k: v for k, v in tensors.items() if "magnitude" not in k},
                                plain / "adapter_model.safetensors")
    llm = make_llm(tiny_model_dir, adapter_dirs, ("dora_r8_all",))
    llm.add_adapter("plain", plain)
    prompt = random_prompts(1, (12, 12), VOCAB, seed=82)[0]
    dora, lora = llm.generate([prompt, prompt], params(1, prompt_logprobs=0), adapters=["dora_r8_all", "plain"])
    gaps = [abs(a.logprob - b.logprob) for a, b in zip(dora.prompt_logprobs[1:], lora.prompt_logprobs[1:])]
    assert max(gaps) > 1e-2


def test_preemption_mid_decode(tiny_model_dir, adapter_dirs, reference):
    # 10 blocks of 16 tokens for 6 sequences of 40-50 prompt tokens and 24 new ones: decodes run out
    # of blocks and are preempted with outputs made, recomputed, and resume.
    llm = make_llm(tiny_model_dir, adapter_dirs, (*LORA, *DORA), kv_cache_blocks=10, max_model_len=128)
    prompts = random_prompts(6, (40, 50), VOCAB, seed=83)
    names = ["dora_r8_all", None, "r8_all", "dora_r4_qv", "dora_r16_pattern", "dora_r16_rslora"]
    scheduler = llm.engine.scheduler
    preempt = scheduler._preempt
    mid_decode: list[int] = []

    def recording(seq, batch):
        if seq.num_output_tokens > 0:
            mid_decode.append(seq.num_output_tokens)
        preempt(seq, batch)

    scheduler._preempt = recording
    p = params(24)
    outs = llm.generate(prompts, p, adapters=names)
    assert mid_decode
    check(outs, prompts, names, p, reference)


def test_forked_choices_match_peft(tiny_model_dir, adapter_dirs, reference):
    llm = make_llm(tiny_model_dir, adapter_dirs, ("dora_r16_pattern", "r8_all"))
    prompt = random_prompts(1, (40, 40), VOCAB, seed=84)[0]
    p = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, logprobs=1)
    outs = llm.generate([prompt, prompt], p, adapters=["dora_r16_pattern", "r8_all"])
    for out, name in zip(outs, ("dora_r16_pattern", "r8_all")):
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3
        for choice in out.outputs:
            assert_matches(choice, prompt, p, reference(name, prompt + choice.token_ids))


def test_paging_dora_adapters_through_two_slots(tiny_model_dir, adapter_dirs, reference):
    """Five adapters, two slots: DoRA and LoRA adapters take each other's slots in turn, and a slot a
    DoRA adapter left serves a LoRA one with scale 1 again."""
    llm = make_llm(tiny_model_dir, adapter_dirs, (*LORA, *DORA), max_loras=2)
    names = ["dora_r8_all", "r8_all", "dora_r4_qv", None, "dora_r16_rslora", "r4_qv", "dora_r16_pattern",
             "dora_r8_all", "r8_all"]
    prompts = random_prompts(len(names), (5, 30), VOCAB, seed=85)
    p = params(5)
    outs = llm.generate(prompts, p, adapters=names)
    check(outs, prompts, names, p, reference)
    one_by_one = [llm.generate([q], p, adapters=[n])[0] for q, n in zip(prompts, names)]
    check(one_by_one, prompts, names, p, reference)
    slots = llm.engine.lora_slots
    assert slots.loads > 2 * len(set(names) - {None}) and slots.evictions > 0
    for slot, dora in enumerate(slots.slot_dora):
        tables = [g.dora_scale[slot] for layer in slots.layers for g in layer.values()]
        assert dora or all(bool((t == 1).all()) for t in tables)


@pytest.mark.parametrize("where", ["host tier", "slot load"])
def test_scales_from_the_host_tier_or_at_slot_load(tiny_model_dir, adapter_dirs, reference, where):
    """A CPU engine computes DoRA scales once per host-tier load (off the step loop; a page-in copies
    them); a CUDA one as the adapter enters its slot. Both paths, on this CPU."""
    llm = make_llm(tiny_model_dir, adapter_dirs, (), max_loras=2)
    host = llm.engine.host
    if where == "slot load":
        host.prepare = None
    for name in ("dora_r8_all", "dora_r16_pattern", "r4_qv"):
        llm.add_adapter(name, adapter_dirs[name])
    packed = [host.entries[llm._versions[n]] for n in ("dora_r8_all", "dora_r16_pattern")]
    assert all(a.magnitudes_are_scales == (where == "host tier") for a in packed)
    names = ["dora_r8_all", "r4_qv", "dora_r16_pattern", None, "dora_r8_all"]
    prompts = random_prompts(len(names), (5, 30), VOCAB, seed=90)
    p = params(4)
    check(llm.generate(prompts, p, adapters=names), prompts, names, p, reference)
    assert llm.engine.lora_slots.evictions > 0


def test_padded_decode_with_dora_rows(tiny_model_dir, adapter_dirs, reference):
    """Decode steps padded to a bucket (what a CUDA graph replays) take the DoRA context when a row's
    adapter is a DoRA one, the LoRA one otherwise."""
    llm = make_llm(tiny_model_dir, adapter_dirs, (*LORA, *DORA), max_num_seqs=8, max_lora_rank=16)
    cfg = llm.engine.config
    keys = staged_keys(llm.engine.runner.use_padded_decode(cfg.lora.max_loras, cfg.scheduler.max_num_seqs,
                                                           cfg.scheduler.max_model_len))
    p = params(4)
    for names in (["dora_r8_all", None, "r4_qv", "dora_r16_rslora", "dora_r4_qv"], ["r8_all", None]):
        prompts = random_prompts(len(names), (5, 20), VOCAB, seed=86)
        check(llm.generate(prompts, p, adapters=names), prompts, names, p, reference)
    assert (8, True, True) in keys and (2, True, False) in keys


def staged_keys(padded) -> list[tuple[int, bool, bool]]:
    """The (bucket, lora, dora) context of every padded decode step `padded` stages from now on."""
    keys = []
    stage = padded.stage

    def spy(*a):
        keys.append(stage(*a))
        return keys[-1]

    padded.stage = spy
    return keys


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton needs a GPU or the interpreter")
def test_triton_kernels_with_dora_rows(tiny_model_dir, adapter_dirs, reference):
    # Real launches on a GPU machine, the interpreter on CPU; a 20-token prompt takes the segmented
    # kernels, decodes the gathered ones, beside a base row and a plain LoRA row.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = make_llm(tiny_model_dir, adapter_dirs, ("dora_r8_all", "r4_qv"), device=device, kernels="triton",
                   max_loras=2, kv_cache_blocks=32, max_model_len=128)
    assert llm.engine.kernels.name == "triton"
    names = ["dora_r8_all", None, "r4_qv"]
    prompts = random_prompts(3, (6, 20), VOCAB, seed=87)
    p = params(3)
    check(llm.generate(prompts, p, adapters=names), prompts, names, p, reference)


def test_a_base_model_with_biases(model_variant_dir, reference, tmp_path):
    """Qwen2's q/k/v biases: PEFT scales x W^T + the LoRA delta, then adds the bias."""
    model_dir = model_variant_dir("qwen2")
    dirs = {"d": make_adapter(model_dir, tmp_path / "d", r=8, lora_alpha=16, seed=88, use_dora=True)}
    llm = make_llm(model_dir, dirs, ("d",))
    prompts = random_prompts(3, (5, 30), VOCAB, seed=89)
    names = ["d", None, "d"]
    p = params(5)
    for prompt, name, out in zip(prompts, names, llm.generate(prompts, p, adapters=names)):
        assert_matches(out, prompt, p, reference(name, prompt + out.token_ids, model_dir, dirs))


# ---- the scales' Redis tier (adapters.dora_scale_store, server.engine.lora.dora_scale_cache) ----

STORED = ("dora_r8_all", "dora_r16_pattern")


@pytest.fixture
def stored(tiny_model_dir, adapter_dirs, redis_client):
    """Two DoRA adapters in a real Redis registry (grace 0: a deleted version is collected at its next
    collection), and engine(model_dir, **kw): an engine paging them in from it, one slot and host room
    for one adapter, that keeps their scales in that Redis."""
    registry = AdapterRegistry(redis_client, grace_seconds=0)
    shape = ModelShape.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    versions, sizes = {}, {}
    for name in STORED:
        cfg, w = ((adapter_dirs[name] / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors"))
        summary = inspect_adapter_bytes(cfg, w, shape, 16)
        versions[name] = registry.put("t", name, summary.canonical_config_json, w, summary=summary).version
        sizes[name] = summary.size_bytes

    def fetch(version):
        return load_adapter_bytes(*registry.read_files(version), shape, 16)

    def engine(model_dir=tiny_model_dir, **kw):
        opts = dict(model=str(model_dir), device="cpu", dtype="float32", max_loras=1, max_lora_rank=16,
                    kv_cache_blocks=64, max_model_len=256, max_cpu_lora_bytes=max(sizes.values()))
        return LLMEngine(EngineConfig.of(**{**opts, **kw}), fetch, DoraScaleStore(redis_client))

    return SimpleNamespace(registry=registry, versions=versions, engine=engine, store=DoraScaleStore(redis_client),
                           redis=redis_client)


def serve(engine, versions, name, reference, seed, model_dir=None, dirs=None) -> None:
    """One request for `name` alone, run to the end; tokens and logprobs equal PEFT's on `model_dir`."""
    prompt = random_prompts(1, (5, 30), VOCAB, seed=seed)[0]
    p = params(4)
    engine.add_request("q", prompt, p, versions[name])
    out = drive(engine)["q"]
    assert out.finish_reason == "length" and len(out.token_ids) == p.max_tokens
    args = () if model_dir is None else (model_dir, dirs)
    assert_matches(out, prompt, p, reference(name, prompt + out.token_ids, *args))


def test_a_reload_reads_the_scales_from_redis(stored, reference):
    """Loaded, evicted from the host tier and the slot by another adapter, loaded again: the scales come
    from Redis, not computed again, and serve as PEFT does; a fresh engine (another replica, a restart)
    reads them too."""
    engine = stored.engine()
    cache = engine.lora_slots.dora_cache
    for i, name in enumerate(("dora_r8_all", "dora_r16_pattern", "dora_r8_all", "dora_r16_pattern")):
        serve(engine, stored.versions, name, reference, seed=100 + i)
    stats = engine.stats()
    assert stats.host.evictions >= 3 and stats.slots.evictions >= 3 and stats.host.misses == 4
    assert (cache.stats.computed, cache.stats.stored, cache.stats.read, cache.stats.refused) == (2, 2, 2, 0)
    engine.shutdown()
    replica = stored.engine()
    serve(replica, stored.versions, "dora_r16_pattern", reference, seed=104)
    assert (replica.lora_slots.dora_cache.stats.computed, replica.lora_slots.dora_cache.stats.read) == (0, 1)
    assert replica.lora_slots.dora_cache.base == cache.base
    replica.shutdown()


@pytest.mark.parametrize("damage", ["short", "nan", "long"])
def test_corrupt_stored_scales_are_ignored_and_recomputed(stored, reference, damage):
    engine = stored.engine()
    serve(engine, stored.versions, "dora_r8_all", reference, seed=110)
    version, base = stored.versions["dora_r8_all"], engine.lora_slots.dora_cache.base
    good = stored.store.get(version, base)
    bad = {"short": good[:-4], "nan": good[:-4] + torch.tensor([float("nan")]).numpy().tobytes(),
           "long": good + good[:4]}[damage]
    assert stored.store.put(version, base, bad)
    engine.shutdown()
    replica = stored.engine()
    serve(replica, stored.versions, "dora_r8_all", reference, seed=111)
    assert (replica.lora_slots.dora_cache.stats.refused, replica.lora_slots.dora_cache.stats.computed) == (1, 1)
    assert stored.store.get(version, base) == good  # the recomputed scales replaced the damaged ones
    replica.shutdown()


def test_deleting_the_adapter_deletes_its_scales(stored, reference):
    engine = stored.engine()
    serve(engine, stored.versions, "dora_r8_all", reference, seed=120)
    version, base = stored.versions["dora_r8_all"], engine.lora_slots.dora_cache.base
    key = f"lp:ad:dora:{version}"
    assert stored.redis.exists(key) and stored.store.bytes_used(version) == 4 * sum(
        w.magnitude.numel() for w in engine.host.get(version).weights.values())
    stored.registry.delete("t", "dora_r8_all")
    stored.registry.collect_garbage()
    assert not stored.redis.exists(key)
    # A load that finishes after its version was collected leaves nothing behind.
    assert not stored.store.put(version, base, b"\0" * 16) and not stored.redis.exists(key)
    engine.shutdown()


def test_another_base_does_not_reuse_the_scales(stored, reference, tiny_model_dir, adapter_dirs, tmp_path):
    """The same shape with one weight changed, and the same weights served in bfloat16: each computes
    its own scales (and the changed base serves as PEFT does on it); a version keeps at most MAX_BASES."""
    engine = stored.engine()
    serve(engine, stored.versions, "dora_r8_all", reference, seed=130)
    engine.shutdown()
    changed = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, changed)
    weights = safetensors.torch.load_file(changed / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] += 0.5
    safetensors.torch.save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    for model_dir, dtype in ((changed, "float32"), (tiny_model_dir, "bfloat16")):
        other = stored.engine(model_dir, dtype=dtype)
        if dtype == "float32":
            serve(other, stored.versions, "dora_r8_all", reference, seed=131, model_dir=changed, dirs=adapter_dirs)
        else:
            other.add_request("q", [5, 6, 7], params(2), stored.versions["dora_r8_all"])
            drive(other)
        assert (other.lora_slots.dora_cache.stats.read, other.lora_slots.dora_cache.stats.computed) == (0, 1)
        other.shutdown()
    version = stored.versions["dora_r8_all"]
    assert stored.redis.hlen(f"lp:ad:dora:{version}") == 3
    bases = [f"{i:064x}" for i in range(MAX_BASES)]
    assert [stored.store.put(version, b, b"\0" * 4) for b in bases] == [True] * (MAX_BASES - 3) + [False] * 3


# ---- scales computed when a version is accepted (server.engine.lora.dora_precompute) ----

def test_scales_precomputed_at_intake_make_the_first_load_a_reload(stored, reference, monkeypatch):
    """An engine with a store computes its base identity at start-up, once; a version submitted at
    intake has its scales computed and stored (a second submit finds them), and its first load reads
    them and serves as PEFT does."""
    identities = []
    real = dora_scale_cache.served_weights_identity
    monkeypatch.setattr(dora_scale_cache, "served_weights_identity", lambda w: identities.append(1) or real(w))
    engine = stored.engine()
    assert identities == [1]
    cache, version = engine.lora_slots.dora_cache, stored.versions["dora_r8_all"]
    adapter = load_adapter_bytes(*stored.registry.read_files(version), engine.adapter_shape, 16)
    assert engine.dora_precompute.submit(version, adapter).result() == "computed"
    assert stored.store.get(version, cache.base) is not None
    assert engine.dora_precompute.submit(version, adapter).result() == "present"
    serve(engine, stored.versions, "dora_r8_all", reference, seed=140)
    stats = cache.stats
    assert (stats.computed, stats.precomputed, stats.stored, stats.read, stats.refused) == (1, 1, 1, 1, 0)
    assert identities == [1]
    engine.shutdown()


def test_past_the_queue_bound_the_first_load_computes(stored, reference, monkeypatch):
    monkeypatch.setattr(dora_precompute, "MAX_PENDING", -1)  # every submit finds the queue full
    engine = stored.engine()
    version = stored.versions["dora_r16_pattern"]
    adapter = load_adapter_bytes(*stored.registry.read_files(version), engine.adapter_shape, 16)
    assert engine.dora_precompute.submit(version, adapter).result() == "busy"
    assert stored.store.get(version, engine.lora_slots.dora_cache.base) is None
    serve(engine, stored.versions, "dora_r16_pattern", reference, seed=141)
    stats = engine.lora_slots.dora_cache.stats
    assert (stats.precompute_skipped, stats.computed, stats.precomputed, stats.read) == (1, 1, 0, 0)
    engine.shutdown()


def test_without_a_store_nothing_is_precomputed(stored, monkeypatch, tiny_model_dir):
    """The offline engine keeps no scales: no identity at start-up, intake answers "off"; nor does an
    engine whose host tier has no loader hook (CUDA: scales computed in the slot), even with a store."""
    identities = []
    monkeypatch.setattr(dora_scale_cache, "served_weights_identity", lambda w: identities.append(1) or "x")
    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", dtype="float32", max_loras=1,
                                       max_lora_rank=16, kv_cache_blocks=64, max_model_len=256))
    version = stored.versions["dora_r8_all"]
    adapter = load_adapter_bytes(*stored.registry.read_files(version), engine.adapter_shape, 16)
    assert engine.dora_precompute.submit(version, adapter).result() == "off"
    cuda_like = dora_precompute.DoraPrecompute(HostTier(None, None),
                                               dora_scale_cache.DoraScaleCache(stored.store, engine.lora_slots.dora.weights))
    assert cuda_like.submit(version, adapter).result() == "off"
    assert identities == [] and not stored.redis.exists(f"lp:ad:dora:{version}")
    engine.shutdown()
