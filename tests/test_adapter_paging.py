"""Adapters paged Redis -> host -> device on demand, under byte and slot budgets, fair across tenants."""
from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adapters.format import inspect_adapter_bytes, load_adapter_bytes, load_adapter_dir
from adapters.registry import AdapterRegistry
from server.engine import LLMEngine, EngineConfig, SamplingParams
from tests.engine_helpers import drive, greedy, random_prompts

VOCAB = 512


def write_adapter(template: Path, out: Path, r: int, seed: int) -> Path:
    """A PEFT-format adapter like `template` (same targets) with rank r and seeded random weights."""
    cfg = json.loads((template / "adapter_config.json").read_text())
    cfg.update(r=r, lora_alpha=2 * r, rank_pattern={}, alpha_pattern={}, use_rslora=False)
    from safetensors import safe_open

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(str(template / "adapter_model.safetensors"), "pt") as f:
        for key in f.keys():
            shape = list(f.get_slice(key).get_shape())
            if ".lora_A." in key:
                shape[0] = r
            else:
                shape[1] = r
            tensors[key] = torch.randn(shape, generator=g) * (0.3 if ".lora_A." in key else 0.15)
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


class PeftMultiOracle:
    """One PeftModel that loads each adapter once, for checking hundreds of adapters quickly."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model_dir = model_dir
        self.base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.peft = None

    @torch.inference_mode()
    def __call__(self, adapter_dir: Path | None, name: str, prompt: list[int], n: int) -> list[int]:
        from peft import PeftModel

        ids = torch.tensor([prompt])
        if adapter_dir is None:
            model = self.base if self.peft is None else None
            if model is None:
                with self.peft.disable_adapter():
                    return self._greedy(self.peft, ids, n)
            return self._greedy(model, ids, n)
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.base, adapter_dir, adapter_name=name)
        elif name not in self.peft.peft_config:
            self.peft.load_adapter(adapter_dir, adapter_name=name)
        self.peft.set_adapter(name)
        return self._greedy(self.peft, ids, n)

    @staticmethod
    def _greedy(model, ids, n):
        out = []
        for _ in range(n):  # no KV cache: simplest possible reference
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        return out


def check_tiers(budget: int, slots: int):
    def check(engine: LLMEngine) -> None:
        host, dev = engine.host, engine.slots
        assert host.bytes_used <= budget
        assert host.bytes_used == sum(a.size_bytes for a in host.entries.values())
        assert dev.num_resident <= slots
        for seq in engine.scheduler.running:
            if seq.adapter_id:  # an adapter in use is resident in both tiers
                assert seq.adapter_id in host.entries
                assert seq.adapter_id in dev.slot_of
        assert set(host.pins) <= set(host.entries)

    return check


def test_200_adapters_8_slots_32_host_budget_from_redis(tiny_model_dir, tiny_adapters, tmp_path, redis_client):
    template = tiny_adapters["r8_all"]
    ranks = [4, 8, 16]
    dirs = {f"a{i:03d}": write_adapter(template, tmp_path / f"a{i:03d}", ranks[i % 3], seed=1000 + i)
            for i in range(200)}
    engine_cfg = EngineConfig(model=str(tiny_model_dir), device="cpu", max_loras=8, max_lora_rank=16,
                              kv_cache_blocks=128, max_model_len=256, max_num_seqs=16)
    registry = AdapterRegistry(redis_client)
    from adapters.format import ModelShape

    shape = ModelShape.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    versions, sizes = {}, {}
    for name, d in dirs.items():
        cfg, w = (d / "adapter_config.json").read_bytes(), (d / "adapter_model.safetensors").read_bytes()
        summary = inspect_adapter_bytes(cfg, w, shape, 16)
        versions[name] = registry.put("t", name, cfg, w, summary=summary).version
        sizes[name] = summary.size_bytes
    budget = 32 * sizes["a001"]  # room for 32 rank-8 adapters

    def fetch(version: str):
        cfg, w = registry.read_files(version)
        return load_adapter_bytes(cfg, w, shape, 16)

    engine = LLMEngine(
        EngineConfig(**{**engine_cfg.__dict__, "max_cpu_lora_bytes": budget}), adapter_source=fetch
    )
    rng = random.Random(7)
    names = [f"a{int(200 * rng.random() ** 2):03d}" for _ in range(150)] + [None] * 10  # skewed popularity
    rng.shuffle(names)
    prompts = random_prompts(len(names), (4, 12), VOCAB, seed=8)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"q{i}", prompt, greedy(3), versions[name] if name else None)
    final = drive(engine, check_tiers(budget, 8))
    stats = engine.stats()
    assert stats.host_evictions > 0 and stats.device_evictions > 0  # both budgets were under pressure
    assert stats.host_misses > 32 and stats.host_load_failures == 0
    oracle = PeftMultiOracle(tiny_model_dir)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        out = final[f"q{i}"]
        assert out.finish_reason == "length"
        assert out.token_ids == oracle(dirs[name] if name else None, name, prompt, 3), name
    assert stats.kv_blocks_used == 0 and not engine.host.pins and not engine.slots.users
    engine.shutdown()


def test_slow_load_does_not_stall_resident_adapters(tiny_model_dir, tiny_adapters):
    gate = threading.Event()
    shape_src = {}

    def fetch(version: str):
        assert version == "slow@1"
        gate.wait(10)  # a deliberately slow registry read
        return load_adapter_dir(tiny_adapters["r16_rslora"], shape_src["shape"], 64)

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_loras=4, kv_cache_blocks=64,
                                    max_model_len=256), adapter_source=fetch)
    shape_src["shape"] = engine.adapter_shape
    engine.add_adapter("fast@1", load_adapter_dir(tiny_adapters["r8_all"], engine.adapter_shape, 64))
    engine.add_request("slow", [5, 6, 7, 8], greedy(4), "slow@1")
    for i in range(6):
        engine.add_request(f"fast{i}", [9 + i, 10, 11], greedy(6), "fast@1" if i % 2 else None)
    done = {}
    while len(done) < 6:
        for out in engine.step():
            done[out.request_id] = out
            assert out.request_id != "slow" or not out.finished
        done = {k: v for k, v in done.items() if v.finished}
    # Every request for a resident adapter (or none) finished while the slow load is still in flight.
    assert "slow@1" in engine.host.loading
    gate.set()
    final = drive(engine)
    assert final["slow"].finish_reason == "length" and len(final["slow"].token_ids) == 4
    engine.shutdown()


def test_failed_load_errors_that_request_only(tiny_model_dir):
    def fetch(version: str):
        raise KeyError(f"no such version {version}")

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64, max_model_len=256),
                       adapter_source=fetch)
    engine.add_request("bad", [5, 6, 7], greedy(3), "gone@1")
    engine.add_request("ok", [5, 6, 7], greedy(3))
    final = drive(engine)
    assert final["bad"].finish_reason == "error" and "gone@1" in final["bad"].error
    assert final["ok"].finish_reason == "length"
    engine.shutdown()


def test_remove_while_in_use_finishes_then_frees_every_tier(tiny_model_dir, tiny_adapters, peft_oracle):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64, max_model_len=256))
    engine.add_adapter("v1", load_adapter_dir(tiny_adapters["r8_all"], engine.adapter_shape, 64))
    prompt = [5, 6, 7, 8, 9]
    engine.add_request("r", prompt, greedy(6), "v1")
    engine.step()
    engine.remove_adapter("v1")  # deleted while a request runs on it
    final = drive(engine)
    assert final["r"].token_ids == peft_oracle(tiny_model_dir, tiny_adapters["r8_all"], prompt, 6)
    assert "v1" not in engine.host.entries and engine.host.bytes_used == 0
    assert "v1" not in engine.slots.slot_of and len(engine.slots.free_slots) == engine.slots.max_loras
    assert all(float(b.a.abs().sum()) == 0 for groups in engine.slots.layers for b in groups.values())
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("again", prompt, greedy(2), "v1")


def tokens_while_backlogged(engine: LLMEngine, tenants=("A", "B")) -> dict[str, int]:
    """Tokens generated per tenant during steps in which every tenant still has requests waiting."""
    counts = {t: 0 for t in tenants}
    tenant_of = {rid: s.tenant for rid, s in engine.seqs.items()}
    while True:
        waiting = {s.tenant for s in engine.scheduler.waiting.ordered()}
        if not all(t in waiting for t in tenants):
            return counts
        for out in engine.step():
            if out.token_ids:
                counts[tenant_of[out.request_id]] += 1


@pytest.mark.parametrize("weights, expected_ratio", [((1.0, 1.0), 1.0), ((2.0, 1.0), 2.0)])
def test_fair_share_between_a_flooding_and_a_light_tenant(tiny_model_dir, weights, expected_ratio):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=128,
                                    max_model_len=256, max_num_seqs=4))
    prompts = random_prompts(220, (8, 8), VOCAB, seed=9)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # A floods first (10x the requests of B), then B arrives.
    for i in range(200):
        engine.add_request(f"A{i}", prompts[i], params, tenant="A", tenant_weight=weights[0])
    engine.step()
    for i in range(20):
        engine.add_request(f"B{i}", prompts[200 + i], params, tenant="B", tenant_weight=weights[1])
    counts = tokens_while_backlogged(engine)
    assert counts["B"] > 40
    ratio = counts["A"] / counts["B"]
    assert abs(ratio - expected_ratio) <= 0.2 * expected_ratio, counts


def test_priority_orders_within_a_tenant(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64,
                                    max_model_len=256, max_num_seqs=1))
    for i, prio in enumerate([5, 0, 9, -1]):
        engine.add_request(f"p{prio}", [5, 6, 7 + i], greedy(2), tenant="T", priority=prio)
    assert list(drive(engine)) == ["p-1", "p0", "p5", "p9"]


def test_requests_for_a_loading_adapter_share_one_load(tiny_model_dir, tiny_adapters):
    gate, calls = threading.Event(), []
    shape = {}

    def fetch(version: str):
        calls.append(version)
        gate.wait(10)
        return load_adapter_dir(tiny_adapters["r8_all"], shape["s"], 64)

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64, max_model_len=256),
                       adapter_source=fetch)
    shape["s"] = engine.adapter_shape
    for i in range(5):
        engine.add_request(f"r{i}", [5, 6, 7 + i], greedy(3), "shared@1")
    for _ in range(3):
        engine.step()
    gate.set()
    final = drive(engine)
    assert calls == ["shared@1"]  # five waiting requests, one fetch
    assert all(final[f"r{i}"].finish_reason == "length" for i in range(5))
    assert engine.stats().host_misses == 1 and engine.stats().host_loads == 1
    engine.shutdown()


def test_thousands_of_waiting_requests_are_scanned_within_a_horizon(tiny_model_dir):
    from server.engine.scheduler import SCAN_HORIZON

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64,
                                    max_model_len=256, max_num_seqs=4))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(3000):  # 1000 tenants, and one literally named "None" beside the None tenant
        engine.add_request(f"w{i}", [5, 6, 7], params, tenant=None if i % 1000 == 0 else f"t{i % 1000}")
    engine.add_request("named-none", [5, 6, 7], params, tenant="None")
    queue = engine.scheduler.waiting
    examined = []
    original = queue.ordered

    def counting():
        for n, seq in enumerate(original(), 1):
            examined.append(n)
            yield seq

    queue.ordered = counting
    for _ in range(3):
        examined.clear()
        engine.step()
        assert 0 < len(examined) <= SCAN_HORIZON < 3000  # a step's cost does not grow with the queue
    assert engine.stats().num_running == 4 and engine.stats().num_waiting == 2997
