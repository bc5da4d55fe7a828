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

from adapters.format import ModelShape, inspect_adapter_bytes, load_adapter_bytes, load_adapter_dir
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

    def each(self, asks: list[tuple[Path | None, str | None, list[int], int]]) -> list[list[int]]:
        """Greedy tokens for each (adapter_dir, name, prompt, n), in order, computed adapter by adapter:
        each adapter is loaded once and deleted once its prompts are done. PEFT's load_adapter and
        set_adapter walk every loaded adapter's modules, so a model holding ~100 adapters made each
        load cost about a second; this way it holds at most two."""
        out: list[list[int] | None] = [None] * len(asks)
        for i in sorted(range(len(asks)), key=lambda i: asks[i][1] or ""):
            adapter_dir, name, prompt, n = asks[i]
            out[i] = self(adapter_dir, name, prompt, n)
            if name is not None:
                for old in [a for a in self.peft.peft_config if a != name]:
                    self.peft.delete_adapter(old)
        return out

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
        host, dev = engine.host, engine.lora_slots
        assert host.bytes_used <= budget
        assert host.bytes_used == sum(a.size_bytes for a in host.entries.values())
        assert dev.num_resident <= slots
        for seq in engine.scheduler.running:
            if seq.version_id:  # an adapter in use is resident in both tiers
                assert seq.version_id in host.entries
                assert seq.version_id in dev.slot_of
        assert set(host.pins) <= set(host.entries)

    return check


def test_200_adapters_8_slots_32_host_budget_from_redis(tiny_model_dir, tiny_adapters, tmp_path, redis_client):
    template = tiny_adapters["r8_all"]
    ranks = [4, 8, 16]
    dirs = {f"a{i:03d}": write_adapter(template, tmp_path / f"a{i:03d}", ranks[i % 3], seed=1000 + i)
            for i in range(200)}
    engine_cfg = EngineConfig.of(model=str(tiny_model_dir), device="cpu", max_loras=8, max_lora_rank=16,
                                 kv_cache_blocks=128, max_model_len=256, max_num_seqs=16)
    registry = AdapterRegistry(redis_client)
    shape = model_shape(tiny_model_dir)
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
        engine_cfg.with_settings(max_cpu_lora_bytes=budget), adapter_source=fetch
    )
    rng = random.Random(7)
    names = [f"a{int(200 * rng.random() ** 2):03d}" for _ in range(150)] + [None] * 10  # skewed popularity
    rng.shuffle(names)
    prompts = random_prompts(len(names), (4, 12), VOCAB, seed=8)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"q{i}", prompt, greedy(3), versions[name] if name else None)
    final = drive(engine, check_tiers(budget, 8))
    stats = engine.stats()
    assert stats.host.evictions > 0 and stats.slots.evictions > 0  # both budgets were under pressure
    assert stats.host.misses > 32 and stats.host.load_failures == 0
    expected = PeftMultiOracle(tiny_model_dir).each(
        [(dirs[name] if name else None, name, prompt, 3) for prompt, name in zip(prompts, names)])
    for i, name in enumerate(names):
        out = final[f"q{i}"]
        assert out.finish_reason == "length"
        assert out.token_ids == expected[i], name
    assert stats.kv_blocks.used == 0 and not engine.host.pins and not engine.lora_slots.users
    engine.shutdown()


def test_slow_load_does_not_stall_resident_adapters(tiny_model_dir, tiny_adapters):
    gate = threading.Event()
    shape_src = {}

    def fetch(version: str):
        assert version == "slow@1"
        gate.wait(10)  # a deliberately slow registry read
        return load_adapter_dir(tiny_adapters["r16_rslora"], shape_src["shape"], 64)

    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", max_loras=4, kv_cache_blocks=64,
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

    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64, max_model_len=256),
                       adapter_source=fetch)
    engine.add_request("bad", [5, 6, 7], greedy(3), "gone@1")
    engine.add_request("ok", [5, 6, 7], greedy(3))
    final = drive(engine)
    assert final["bad"].finish_reason == "error" and "gone@1" in final["bad"].error
    assert final["ok"].finish_reason == "length"
    engine.shutdown()


def test_remove_while_in_use_finishes_then_frees_every_tier(tiny_model_dir, tiny_adapters, peft_oracle):
    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64, max_model_len=256))
    engine.add_adapter("v1", load_adapter_dir(tiny_adapters["r8_all"], engine.adapter_shape, 64))
    prompt = [5, 6, 7, 8, 9]
    engine.add_request("r", prompt, greedy(6), "v1")
    engine.step()
    engine.remove_adapter("v1")  # deleted while a request runs on it
    final = drive(engine)
    assert final["r"].token_ids == peft_oracle(tiny_model_dir, tiny_adapters["r8_all"], prompt, 6)
    assert "v1" not in engine.host.entries and engine.host.bytes_used == 0
    assert "v1" not in engine.lora_slots.slot_of and len(engine.lora_slots.free_slots) == engine.lora_slots.max_loras
    assert all(float(b.a.abs().sum()) == 0 for groups in engine.lora_slots.layers for b in groups.values())
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
    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=128,
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
    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64,
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

    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64, max_model_len=256),
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
    assert engine.stats().host.misses == 1 and engine.stats().host.loads == 1
    engine.shutdown()


def test_thousands_of_waiting_requests_are_scanned_within_a_horizon(tiny_model_dir):
    from server.engine.scheduler import SCAN_HORIZON

    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64,
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
    assert engine.stats().scheduler.running == 4 and engine.stats().scheduler.waiting == 2997


class Source:
    """An adapter source over PEFT dirs that records every fetch; a version in `gates` waits for its event."""

    def __init__(self, dirs: dict[str, Path]):
        self.dirs, self.calls, self.gates, self.shape = dirs, [], {}, None

    def __call__(self, version: str):
        self.calls.append(version)
        if version in self.gates:
            self.gates[version].wait(10)
        return load_adapter_dir(self.dirs[version], self.shape, 64)

    def engine(self, model_dir: Path, **kw) -> LLMEngine:
        engine = LLMEngine(EngineConfig.of(model=str(model_dir), device="cpu", kv_cache_blocks=64, max_model_len=256,
                                           **kw), adapter_source=self)
        self.shape = engine.adapter_shape
        return engine


def step_until(engine: LLMEngine, done, steps: int = 2000) -> None:
    for _ in range(steps):
        if done():
            return
        engine.step()
        time.sleep(0.001)  # let the loader threads run
    raise AssertionError("condition never reached")


def test_adapter_larger_than_the_host_budget_fails_at_once(tiny_model_dir, tiny_adapters):
    source = Source({"big@1": tiny_adapters["r8_all"]})
    engine = source.engine(tiny_model_dir, max_cpu_lora_bytes=1000)
    size = load_adapter_dir(tiny_adapters["r8_all"], engine.adapter_shape, 64).size_bytes
    for i in range(3):
        engine.add_request(f"big{i}", [5, 6, 7 + i], greedy(3), "big@1")
    engine.add_request("base", [5, 6, 7], greedy(3))
    final = drive(engine, max_steps=500)  # before: the load was retried every step, forever
    for i in range(3):
        assert final[f"big{i}"].finish_reason == "error"
        assert final[f"big{i}"].error == (f"adapter big@1 could not be loaded: adapter needs {size} bytes, more "
                                          "than the host budget of 1000 bytes (--max-cpu-lora-bytes)")
    assert final["base"].finish_reason == "length"
    assert source.calls == ["big@1"]  # the waiting requests shared one load, and nobody retried it
    stats = engine.stats()
    assert stats.host.misses == 1 and stats.host.load_failures == 1 and stats.host.bytes_used == 0
    engine.shutdown()


def model_shape(model_dir: Path) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))


def park_b_behind_a(tiny_model_dir, tiny_adapters):
    """A budget with room for one adapter, pinned by a running request on A; B's load finishes meanwhile."""
    dirs = {"A": tiny_adapters["r8_all"], "B": tiny_adapters["r16_rslora"]}
    source = Source(dirs)
    sizes = {v: load_adapter_dir(d, model_shape(tiny_model_dir), 64).size_bytes for v, d in dirs.items()}
    engine = source.engine(tiny_model_dir, max_cpu_lora_bytes=max(sizes.values()))
    engine.add_request("a", [5, 6, 7, 8], greedy(200), "A")
    step_until(engine, lambda: engine.stats().scheduler.running == 1)
    engine.add_request("b", [9, 10, 11], greedy(4), "B")
    step_until(engine, lambda: "B" in engine.host.parked)
    return engine, source, sizes


def test_load_that_finds_every_byte_pinned_is_parked_not_fetched_again(tiny_model_dir, tiny_adapters, peft_oracle):
    engine, source, sizes = park_b_behind_a(tiny_model_dir, tiny_adapters)
    for _ in range(20):  # A stays pinned: B waits, loaded, without another fetch or miss
        engine.step()
        time.sleep(0.001)
        stats = engine.stats()
        assert stats.host.parked == 1 and stats.host.parked_bytes == sizes["B"]
        assert stats.host.misses == 2 and stats.host.loads == 1 and stats.host.bytes_used == sizes["A"]
    assert source.calls == ["A", "B"]
    engine.abort_request("a")  # room frees: B goes in at once
    final = drive(engine)
    assert final["b"].token_ids == peft_oracle(tiny_model_dir, tiny_adapters["r16_rslora"], [9, 10, 11], 4)
    stats = engine.stats()
    assert source.calls == ["A", "B"] and stats.host.misses == 2 and stats.host.loads == 2
    assert stats.host.parked == 0 and stats.host.evictions == 1 and list(engine.host.entries) == ["B"]
    engine.shutdown()


def test_removing_a_parked_version_drops_it(tiny_model_dir, tiny_adapters):
    engine, source, _ = park_b_behind_a(tiny_model_dir, tiny_adapters)
    engine.abort_request("b")
    engine.remove_adapter("B")
    assert "B" not in engine.host.parked and engine.stats().host.parked_bytes == 0
    engine.abort_request("a")
    drive(engine)
    assert list(engine.host.entries) == ["A"] and source.calls == ["A", "B"]
    engine.shutdown()


def test_parked_and_in_flight_loads_stay_within_the_prefetch_window(tiny_model_dir, tiny_adapters):
    from server.engine.scheduler import PREFETCH_WINDOW

    names = [f"v{i}" for i in range(PREFETCH_WINDOW + 4)]
    source = Source({"A": tiny_adapters["r8_all"], **{n: tiny_adapters["r4_qv"] for n in names}})
    budget = load_adapter_dir(tiny_adapters["r8_all"], model_shape(tiny_model_dir), 64).size_bytes
    engine = source.engine(tiny_model_dir, max_cpu_lora_bytes=budget, max_loras=2)
    engine.add_request("a", [5, 6, 7, 8], greedy(200), "A")
    step_until(engine, lambda: engine.stats().scheduler.running == 1)
    for i, name in enumerate(names):
        engine.add_request(name, [9, 10, 11 + i], greedy(2), name)
    step_until(engine, lambda: len(engine.host.parked) == PREFETCH_WINDOW)
    for _ in range(20):
        engine.step()
        assert len(engine.host.parked) + len(engine.host.loading) <= PREFETCH_WINDOW
    assert sorted(source.calls) == sorted(["A", *names[:PREFETCH_WINDOW]])  # no fetch twice, none beyond
    engine.abort_request("a")
    final = drive(engine)
    assert all(final[n].finish_reason == "length" for n in names)
    assert len(source.calls) == len(set(source.calls))  # each adapter fetched once: no thrash on insert
    engine.shutdown()


def test_removed_adapter_without_a_source_fails_its_waiting_request(tiny_model_dir, tiny_adapters):
    engine = LLMEngine(EngineConfig.of(model=str(tiny_model_dir), device="cpu", kv_cache_blocks=64, max_model_len=256))
    engine.add_adapter("v1", load_adapter_dir(tiny_adapters["r8_all"], engine.adapter_shape, 64))
    engine.add_request("r", [5, 6, 7], greedy(3), "v1")
    engine.remove_adapter("v1")  # before the request was admitted: nothing can bring v1 back
    final = drive(engine, max_steps=20)  # before: it waited (and spun) forever
    assert final["r"].finish_reason == "error" and "no adapter source" in final["r"].error


def test_waiting_only_for_a_load_does_not_spin(tiny_model_dir, tiny_adapters):
    source = Source({"slow@1": tiny_adapters["r8_all"]})
    source.gates["slow@1"] = threading.Event()
    engine = source.engine(tiny_model_dir)
    engine.add_request("slow", [5, 6, 7], greedy(3), "slow@1")
    steps, start = 0, time.monotonic()
    while time.monotonic() - start < 0.5:
        engine.step()
        steps += 1
    assert steps <= 0.5 / 0.005 + 10  # each idle step waits for the load (up to 5 ms), not a busy loop
    source.gates["slow@1"].set()
    assert drive(engine)["slow"].finish_reason == "length"
    engine.shutdown()
