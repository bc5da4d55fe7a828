"""The CUDA path's logic, checked without a GPU: device binding on every thread, KV pool sizing,
freeing the unfused weights, the token budget's bound, the host tier's dtype and bytes, coalesced
slot loads, and the warm-up steps (issue 12, faults 2, 4-7)."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from adapters.format import load_adapter_dir
from adapters.host_tier import HostTier
from adapters.packed import PackedLoraAdapter, pack_adapter
from benchmarks.aot.aot_shapes import MODELS, meta_weights
from kernels.metadata import GATHER_MAX_SEG_LEN, MIN_SPLIT_TOKENS, TILE_ROWS, lora_work, runs
from kernels.lora_tiles import lora_tiles
from server.engine import LLM
from server.engine import kv_cache as kv
from server.engine.async_engine import AsyncEngine
from server.engine.config import MAX_NUM_BATCHED_TOKENS, EngineConfig, ModelConfig
from server.engine.cuda_device import thread_binder
from server.engine.kernel_choice import select_kernels
from server.engine.kv_cache import allocate_lora_slots
from server.engine.lora.slots import LoraSlots
from server.engine.model import CausalLM
from server.engine.warmup import SyntheticSeq, SyntheticStep, rank_classes, step_inputs, warmup_steps

LLAMA3_8B = ModelConfig.from_dict(MODELS["llama3-8b"])


class FakeCuda:
    """torch.cuda as a 4-GPU machine whose current device is 2; records set_device per thread."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, int]] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
        monkeypatch.setattr(torch.cuda, "set_device",
                            lambda index: self.calls.append((threading.current_thread().name, index)))


def test_cuda_index_is_resolved_and_checked(monkeypatch) -> None:
    FakeCuda(monkeypatch)
    assert EngineConfig.of(model="m", device="cuda:3").device.resolve_device() == torch.device("cuda", 3)
    assert EngineConfig.of(model="m", device="cuda").device.resolve_device() == torch.device("cuda", 2)
    assert EngineConfig.of(model="m", device="auto").device.resolve_device() == torch.device("cuda", 2)
    assert EngineConfig.of(model="m", device="cpu").device.resolve_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="cuda:7 does not exist"):
        EngineConfig.of(model="m", device="cuda:7").device.resolve_device()


def test_cuda_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="needs CUDA"):
        EngineConfig.of(model="m", device="cuda:1").device.resolve_device()


def test_every_thread_binds_the_engine_device(monkeypatch) -> None:
    fake = FakeCuda(monkeypatch)
    bind = thread_binder(torch.device("cuda", 3))
    worker = threading.Thread(target=bind, name="loader")
    worker.start()
    worker.join()
    bind()
    assert fake.calls == [("loader", 3), (threading.current_thread().name, 3)]
    thread_binder(torch.device("cpu"))()  # nothing to bind
    assert len(fake.calls) == 2
    with pytest.raises(ValueError, match="explicit device index"):
        thread_binder(torch.device("cuda"))


def test_the_engine_loop_thread_binds_first() -> None:
    bound: list[str] = []

    class Engine:
        def bind_thread(self) -> None:
            bound.append(threading.current_thread().name)

        def stats(self) -> None:
            return None

        def has_unfinished_requests(self) -> bool:
            return False

        detokenizer = None  # the front end's text: no request here needs it

    loop = AsyncEngine(Engine())
    loop.start()
    for _ in range(200):
        if bound:
            break
        time.sleep(0.01)
    loop.shutdown()
    assert bound == ["loraplex-engine"]


def test_loader_threads_bind_before_loading(tiny_model_dir, tiny_adapters) -> None:
    threads: list[str] = []
    host = HostTier(lambda v: load_adapter_dir(tiny_adapters["r4_qv"], _shape(tiny_model_dir), 64), None,
                    init_thread=lambda: threads.append(threading.current_thread().name))
    host.prefetch("v1")
    for _ in range(500):
        if host.collect() == {} and host.ready("v1"):
            break
        time.sleep(0.01)
    host.shutdown()
    assert host.ready("v1") and threads and all(t.startswith("adapter-load") for t in threads)


def test_kv_pool_sizing_arithmetic() -> None:
    gib = 1 << 30
    # 80 GiB device, 20 GiB free, 90%: the engine may use 72 GiB, 60 are in use, 2 are kept for a step.
    assert kv.kv_pool_bytes(free=20 * gib, total=80 * gib, utilization=0.9, reserve=2 * gib) == 10 * gib
    assert kv.kv_pool_bytes(free=5 * gib, total=80 * gib, utilization=0.9, reserve=0) < 0  # over budget already
    per_block = kv.kv_bytes_per_block(LLAMA3_8B, 16, torch.bfloat16)
    assert per_block == 2 * 32 * 16 * 8 * 128 * 2  # K and V, 32 layers, 16 tokens, 8 heads x 128, bf16
    act = kv.activation_bytes(LLAMA3_8B, 2048, 256, torch.bfloat16)
    per_token = 4 * 4096 + 4 * 14336 + 4096 + 2 * 1024
    assert act == 2048 * per_token * 2 + 256 * 128256 * (2 + 8)
    assert 0.25 * gib < act < 1 * gib


def test_kv_sizing_empties_the_allocator_cache_first(monkeypatch) -> None:
    events: list[str] = []
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))

    def mem_get_info(device):
        events.append(f"mem_get_info({device})")
        return 30 * gib, 80 * gib

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    cfg = EngineConfig.of(model="m", gpu_memory_utilization=0.9, max_num_batched_tokens=2048, max_num_seqs=256)
    blocks = kv.num_kv_blocks(LLAMA3_8B, cfg, torch.bfloat16, torch.device("cuda", 1), max_len=8192)
    assert events == ["empty_cache", "mem_get_info(cuda:1)"]
    budget = int(80 * gib * 0.9) - 50 * gib - kv.activation_bytes(LLAMA3_8B, 2048, 256, torch.bfloat16)
    assert blocks == budget // kv.kv_bytes_per_block(LLAMA3_8B, 16, torch.bfloat16)
    assert blocks * 16 > 140_000  # ~22 GiB of bf16 KV: 140k+ tokens of Llama-3-8B context


def test_building_the_model_frees_the_unfused_projections() -> None:
    cfg = ModelConfig.from_dict({**MODELS["qwen2-7b"], "num_hidden_layers": 2})
    weights = meta_weights(cfg, torch.bfloat16)
    CausalLM(cfg, weights, allocate_lora_slots(cfg, 2, 8, torch.bfloat16, "meta"), 64, 32)
    assert not [k for k in weights if k.startswith("model.layers.")]  # every layer's tensors were taken
    # An untied lm_head is taken too, so a quantized one (quantize_lm_head) leaves no float copy behind.
    assert set(weights) == {"model.embed_tokens.weight", "model.norm.weight"}


def test_token_budget_is_bounded() -> None:
    EngineConfig.of(model="m", max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be <="):
        EngineConfig.of(model="m", max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS + 1)


def _shape(model_dir):
    from adapters.format import ModelShape

    return ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_tier_keeps_adapters_in_the_serving_dtype(tiny_model_dir, tiny_adapters, dtype) -> None:
    adapter = load_adapter_dir(tiny_adapters["r8_all"], _shape(tiny_model_dir), 64)
    fp32_bytes = adapter.size_bytes
    host = HostTier(None, budget_bytes=10 * fp32_bytes, dtype=dtype, pin_memory=torch.cuda.is_available())
    host.add("v", adapter)
    kept = host.get("v")
    assert isinstance(kept, PackedLoraAdapter) and kept.flat.dtype == dtype
    elem = torch.empty((), dtype=dtype).element_size()
    assert kept.size_bytes == fp32_bytes * elem // 4 == host.bytes_used == kept.flat.numel() * elem
    assert kept.flat.is_pinned() == torch.cuda.is_available()
    base = kept.flat.data_ptr()
    for key, w in adapter.weights.items():  # every tensor a view of the one buffer, values cast once
        got = kept.weights[key]
        assert got.a.dtype == dtype and got.a.untyped_storage().data_ptr() == base
        assert torch.equal(got.a, w.a.to(dtype)) and torch.equal(got.b, w.b.to(dtype))
        assert got.scaling == w.scaling
    assert host.packed(kept) is kept  # already as the tier keeps it: no second copy
    host.remove("v")
    assert host.bytes_used == 0


def test_packed_spans_fit_a_staging_buffer(tiny_model_dir, tiny_adapters) -> None:
    packed = pack_adapter(load_adapter_dir(tiny_adapters["r8_all"], _shape(tiny_model_dir), 64), torch.float32, False)
    sizes = packed.module_numel
    for limit in (1, max(sizes), 3 * max(sizes), sum(sizes)):
        spans = packed.spans(limit)
        assert [k for first, last in spans for k in range(first, last)] == list(range(len(sizes)))
        for first, last in spans:
            lo, hi = packed.extent(first, last)
            assert hi - lo == sum(sizes[first:last]) and (hi - lo <= limit or last - first == 1)
    assert len(packed.spans(sum(sizes))) == 1  # the whole adapter: one copy


def test_slot_load_and_evict_are_batched_copies(tiny_model_dir, tiny_adapters, monkeypatch) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir)
    slots = LoraSlots(allocate_lora_slots(cfg, 2, 16, torch.float32, "cpu"), 2)
    adapter = pack_adapter(load_adapter_dir(tiny_adapters["r8_all"], _shape(tiny_model_dir), 16), torch.float32,
                           False)
    calls: list[int] = []
    real_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (calls.append(len(dst)), real_copy(dst, src)))
    slot = slots.acquire("v", adapter)
    assert calls == [2 * len(adapter.weights), len(adapter.weights)]  # A and B^T of every module, then scalings
    groups = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
              "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
    for (layer, proj), w in adapter.weights.items():
        group, i = groups[proj]
        buffers = slots.layers[layer][group]
        assert torch.equal(buffers.a[i, slot, :8], w.a) and torch.equal(buffers.b[i][slot, :, :8], w.b)
        assert float(buffers.scaling[i, slot]) == pytest.approx(w.scaling)
        assert buffers.b[i][slot, :, :8].t().is_contiguous()  # rank-major: one block per slot and rank
        assert buffers.a.transpose(0, 1)[slot].is_contiguous()  # slot-major: a slot's slices are one matrix
    slots.release("v")
    slots.remove("v")
    for layer in slots.layers:
        for buffers in layer.values():
            assert not buffers.a.any() and not any(b.any() for b in buffers.b) and not buffers.scaling.any()


def test_warmup_steps_reach_every_plan_class() -> None:
    for max_rank, dtype in ((64, torch.bfloat16), (512, torch.float32), (8, torch.float16)):
        steps = warmup_steps(max_rank, 2048, 8192, dtype)
        assert sorted({s.rank for s in steps}) == rank_classes(max_rank, dtype)
        assert {lora_tiles(dtype).rank_block(s.rank) for s in steps} == {lora_tiles(dtype).rank_block(r)
                                                                          for r in range(1, max_rank + 1)}
        classes = set()
        for step in steps:
            slots = [s.slot for s in step.seqs for _ in range(s.query_len)]
            gather, tiles = lora_work(*runs(slots), GATHER_MAX_SEG_LEN)
            classes |= {"gather"} if gather else set()
            classes |= {rows for rows in TILE_ROWS if tiles[rows]}
        assert classes == {"gather", *TILE_ROWS}
        assert any(s.seqs[0].context_len >= 2 * MIN_SPLIT_TOKENS for s in steps)  # the split decode
    short = warmup_steps(64, 10, 300, torch.bfloat16)  # a tiny budget and context: what can occur
    assert all(sum(s.query_len for s in step.seqs) <= 10 for step in short)
    assert all(s.context_len + s.query_len <= 300 for step in short for s in step.seqs)


def test_warmup_steps_run_through_the_triton_kernels(tiny_model_dir, kernel_device) -> None:
    """Every warm-up step is a valid forward pass (here under the interpreter, on the tiny model)."""
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", kv_cache_blocks=40, max_model_len=600,
              max_num_batched_tokens=128)
    engine = llm.engine
    assert engine.warmup_seconds == 0.0  # nothing to compile on the CPU: warm-up costs nothing there
    if kernel_device.type != "cpu":
        pytest.skip("runs on the GPU at engine start instead")
    ops = select_kernels("triton", kernel_device)
    scratch = torch.zeros(3, 128, engine.config.lora.max_lora_rank)
    kv_caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in engine.runner.kv_caches]
    for step in warmup_steps(engine.config.lora.max_lora_rank, 128, 600, torch.float32):
        ids, ctx, rows = step_inputs(step, ops=ops, block_size=16, lora_scratch=scratch, device="cpu")
        logits = engine.model.forward(ids, kv_caches, ctx, rows)
        assert logits.shape == (1, engine.model_config.vocab_size) and torch.isfinite(logits).all()
    assert all(not k.any() and not v.any() for k, v in kv_caches)  # synthetic steps write no KV


def test_an_engine_on_the_tiled_padded_plan_warms_it_up(tiny_model_dir, kernel_device) -> None:
    """kernels.metadata.PADDED_LORA_FORM "tiled": one more warm-up step, a padded decode batch on the tiled
    plan (the INDEXED segmented kernels, benchmarks/aot/aot_check.py holds both forms to it); a valid
    forward pass (here under the interpreter)."""
    gathered = warmup_steps(16, 128, 600, torch.float32)
    tiled = warmup_steps(16, 128, 600, torch.float32, padded_form="tiled")
    assert tiled[:-1] == gathered and tiled[-1].sorted_tiles and not any(s.sorted_tiles for s in gathered)
    with pytest.raises(ValueError, match="padded_form must be gathered or tiled"):
        warmup_steps(16, 128, 600, torch.float32, padded_form="sorted")
    with pytest.raises(ValueError, match="one query token each"):
        SyntheticStep((SyntheticSeq(8, 1, 0), SyntheticSeq(0, 2, 0)), 16, sorted_tiles=True)
    if kernel_device.type != "cpu":
        pytest.skip("runs on the GPU at engine start instead")
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", kv_cache_blocks=40, max_model_len=600,
              max_num_batched_tokens=128)
    engine = llm.engine
    scratch = torch.zeros(3, 128, engine.config.lora.max_lora_rank)
    kv_caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in engine.runner.kv_caches]
    ids, ctx, rows = step_inputs(tiled[-1], ops=select_kernels("triton", kernel_device), block_size=16,
                                 lora_scratch=scratch, device="cpu")
    assert ctx.lora.padded and ctx.lora.plan.order is not None and ctx.lora.plan.num_gather == 0
    logits = engine.model.forward(ids, kv_caches, ctx, rows)
    assert logits.shape == (1, engine.model_config.vocab_size) and torch.isfinite(logits).all()
