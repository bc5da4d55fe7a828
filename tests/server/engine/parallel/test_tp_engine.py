"""The engine with --tensor-parallel-size 2: workers spawned under it, joined over gloo; its greedy
tokens and logprobs those of TP = 1 for a mixed batch; what is not sharded yet refused in one line;
a worker that dies fails the engine's step instead of hanging it."""
from __future__ import annotations

import os
import re
import signal

import pytest

from adapters.format import load_adapter_dir
from server.demo import make_adapter, make_base_model
from server.engine import LLM, RequestError, SamplingParams
from server.engine.config import ModelConfigError
from tests.engine_helpers import random_prompts

KW = dict(device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=128, max_model_len=256)
NAMES = [None, "r8_all", "r16_rslora", "r8_all", None, "r16_rslora"]
PARAMS = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6, logprobs=0)


@pytest.fixture(scope="module")
def arch_adapters(model_variant_dir, tmp_path_factory):
    """arch -> (model dir, {"r8_all", "r16_rslora": adapter dir}) for the architectures TP shards."""
    built = {}

    def get(arch: str):
        if arch not in built:
            model_dir = model_variant_dir(arch)
            root = tmp_path_factory.mktemp(f"tp-adapters-{arch}")
            built[arch] = model_dir, {
                "r8_all": make_adapter(model_dir, root / "r8_all", r=8, lora_alpha=16, seed=52),
                "r16_rslora": make_adapter(model_dir, root / "r16_rslora", r=16, lora_alpha=16, use_rslora=True,
                                           seed=53)}
        return built[arch]

    return get


def served(llm: LLM, adapters: dict) -> tuple[list, list]:
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    prompts = random_prompts(len(NAMES), (3, 30), 512, seed=4)
    outs = llm.generate(prompts, PARAMS, adapters=NAMES)
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


@pytest.fixture
def tp_llm(tiny_model_dir):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **KW)
    yield llm
    llm.engine.shutdown()


@pytest.mark.parametrize("arch, fully_sharded", [("llama", False), ("llama", True), ("mistral", False),
                                                 ("qwen2", True)])  # qwen2: q/k/v biases, cut with their heads
def test_tp2_engine_matches_tp1(arch, fully_sharded, arch_adapters):
    model_dir, adapters = arch_adapters(arch)
    llm = LLM(model_dir, tensor_parallel_size=2, fully_sharded_loras=fully_sharded, **KW)
    try:
        tokens, logprobs = served(llm, adapters)
        assert llm.engine.runner.comm.calls["all_reduce"] > 0
    finally:
        llm.engine.shutdown()
    want_tokens, want_logprobs = served(LLM(model_dir, **KW), adapters)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert got == pytest.approx(want, abs=1e-4)


def test_dora_adapter_refused_under_tp(tp_llm, tiny_dora_adapters):
    with pytest.raises(RequestError, match="DoRA adapters are not served with --tensor-parallel-size 2"):
        tp_llm.add_adapter("d", tiny_dora_adapters["dora_r8_all"])


def test_dora_adapter_fetched_on_demand_fails_its_load(tp_llm, tiny_dora_adapters):
    """The host tier's on-demand path (LoraSlots.prepare on its loader threads) refuses it too."""
    adapter = load_adapter_dir(tiny_dora_adapters["dora_r8_all"], tp_llm.engine.adapter_shape, 64)
    with pytest.raises(ValueError, match="does not shard DoRA yet"):
        tp_llm.engine.host.packed(adapter, "v-dora")


def test_dead_worker_fails_the_step(tp_llm, tiny_adapters):
    worker = tp_llm.engine.runner.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=30)
    with pytest.raises(Exception):  # a broken pipe, or the gloo collective's error: not a hang
        tp_llm.generate([[5, 6, 7]], PARAMS)


@pytest.mark.parametrize("kw, line", [
    (dict(quantization="int8"), "a quantized base (int8) is not sharded yet"),
    (dict(tensor_parallel_size=3), "does not divide num_attention_heads"),
    (dict(lora_page_rows=8), "does not combine with --lora-page-rows"),
    (dict(fully_sharded_loras=True, max_lora_rank=9), "does not divide --max-lora-rank (9)"),
])
def test_unsharded_setups_refused(tiny_model_dir, kw, line):
    with pytest.raises(ModelConfigError, match=re.escape(line)):
        LLM(tiny_model_dir, **({**KW, "tensor_parallel_size": 2} | kw))


def test_fully_sharded_loras_needs_tensor_parallel(tiny_model_dir):
    with pytest.raises(ValueError, match="fully_sharded_loras needs tensor_parallel_size > 1"):
        LLM(tiny_model_dir, fully_sharded_loras=True, **KW)


def test_unsharded_architecture_refused(tmp_path):
    model_dir = make_base_model(tmp_path, "qwen3", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                                intermediate_size=128)
    with pytest.raises(ModelConfigError, match="architecture Qwen3ForCausalLM is not sharded yet"):
        LLM(model_dir, tensor_parallel_size=2, **KW)
