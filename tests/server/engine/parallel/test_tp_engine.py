"""The engine with --tensor-parallel-size 2: workers spawned under it, joined over gloo; its greedy
tokens and logprobs those of TP = 1 for a mixed batch (base rows, LoRA and DoRA adapters; float, int8
and int4 bases, each against TP = 1 with the same quantization); what is not sharded yet refused in one
line; a worker that dies fails the engine's step instead of hanging it."""
from __future__ import annotations

import os
import re
import signal

import pytest

from benchmarks.engine.moe_models import make_moe_model
from server.demo import make_adapter
from server.engine import LLM
from server.engine.config import ModelConfigError
from tests.engine_helpers import random_prompts
from tests.gptq_writer import write_gptq_checkpoint
from tests.server.engine.parallel.tp_serving import PARAMS, assert_tp_matches_peft, assert_tp_serves_as_tp1

KW = dict(device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=128, max_model_len=256)
NAMES = [None, "r8_all", "r16_rslora", "dora_r8_all", None, "r16_rslora"]


@pytest.fixture(scope="module")
def arch_adapters(model_variant_dir, tmp_path_factory):
    """arch -> (model dir, {"r8_all", "r16_rslora", "dora_r8_all": adapter dir}) for the architectures TP shards."""
    built = {}

    def get(arch: str):
        if arch not in built:
            model_dir = model_variant_dir(arch)
            root = tmp_path_factory.mktemp(f"tp-adapters-{arch}")
            built[arch] = model_dir, {
                "r8_all": make_adapter(model_dir, root / "r8_all", r=8, lora_alpha=16, seed=52),
                "r16_rslora": make_adapter(model_dir, root / "r16_rslora", r=16, lora_alpha=16, use_rslora=True,
                                           seed=53),
                "dora_r8_all": make_adapter(model_dir, root / "dora_r8_all", r=8, lora_alpha=16, use_dora=True,
                                            seed=54)}
        return built[arch]

    return get


@pytest.fixture
def tp_llm(tiny_model_dir):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **{**KW, "max_lora_rank": 16})
    yield llm
    llm.engine.shutdown()


# Llama in both modes is test_tp2_dora_and_quantized_bases_match_tp1's float cases (the tiny model is this
# Llama); Mistral's tiny variant is Llama's config and sharding exactly.
@pytest.mark.parametrize("arch, fully_sharded", [("qwen2", True)])  # qwen2: q/k/v biases, cut with their heads
def test_tp2_engine_matches_tp1(arch, fully_sharded, arch_adapters):
    model_dir, adapters = arch_adapters(arch)
    llm, _, _ = assert_tp_serves_as_tp1(model_dir, adapters, KW, NAMES, 4, fully_sharded_loras=fully_sharded)
    assert llm.engine.runner.comm.calls["all_reduce"] > 0


DORA_NAMES = [None, "r8_all", "dora_r8_all", "dora_r16_pattern", None, "dora_r8_all", "r16_rslora"]


@pytest.fixture(scope="module")
def mixed_adapters(tiny_adapters, tiny_dora_adapters) -> dict:
    """Two LoRA and two DoRA adapters of the tiny model (DORA_NAMES' batch)."""
    return {"r8_all": tiny_adapters["r8_all"], "r16_rslora": tiny_adapters["r16_rslora"],
            "dora_r8_all": tiny_dora_adapters["dora_r8_all"],
            "dora_r16_pattern": tiny_dora_adapters["dora_r16_pattern"]}


# The LoRA sharding mode does not touch the base's weights: each quantization once, in one mode each.
@pytest.mark.parametrize("quant, fully_sharded", [
    ({}, False), ({}, True), (dict(quantization="int8", quantize_lm_head=True), False),
    (dict(quantization="int4"), True),
], ids=["float", "float-fully", "int8-lm_head", "int4-fully"])
def test_tp2_dora_and_quantized_bases_match_tp1(tiny_model_dir, mixed_adapters, quant, fully_sharded):
    """DoRA's per-column scales are the full rows' (whatever the shard), and a quantized base is TP = 1's
    quantized weights cut: TP = 2 serves TP = 1's tokens, logprobs within 1e-4."""
    llm, _, _ = assert_tp_serves_as_tp1(tiny_model_dir, mixed_adapters, {**KW, **quant, "max_lora_rank": 16},
                                   DORA_NAMES, 5, fully_sharded_loras=fully_sharded)
    assert llm.engine.lora_slots.dora_cache.stats.computed >= 2  # rank 0 computed the DoRA scales
    comm = llm.engine.runner.comm
    assert comm.bytes["all_reduce"] > 0 and comm.bytes["all_gather"] > 0
    # Fully sharded: a gather of the shrink per column layer (2 a layer) beside the logits' one per step.
    assert (2 * comm.calls["all_gather"] > comm.calls["all_reduce"]) == fully_sharded
    layer = llm.engine.runner.model.layers[0]
    want = {None: "Tensor", "int8": "Int8Weight", "int4": "Int4Weight"}[quant.get("quantization")]
    assert {type(layer.qkv.weight).__name__, type(layer.o.weight).__name__} == {want}  # the shards stay quantized


def test_tp2_paged_adapter_memory_matches_tp1_and_peft(tiny_model_dir, mixed_adapters, peft_oracle):
    """--lora-page-rows 4 under TP = 2: ranks 8 and 16 in pages of 4, two slots' worth of pages for four
    adapters (loads and evictions between steps, which the workers see in the shared pages), each rank
    reading its columns of the pages through the step's page table."""
    kw = {**KW, "max_loras": 2, "max_lora_rank": 16, "lora_page_rows": 4}
    llm, tokens, logprobs = assert_tp_serves_as_tp1(tiny_model_dir, mixed_adapters, kw, DORA_NAMES, 8)
    assert llm.engine.lora_slots.paging.paged and llm.engine.lora_slots.evictions > 0  # pages reused mid-run
    assert_tp_matches_peft(tiny_model_dir, mixed_adapters, DORA_NAMES, 8, tokens, logprobs, peft_oracle)


def test_tp2_serves_a_gptq_checkpoint_as_tp1(tiny_model_dir, mixed_adapters, tmp_path):
    """A GPTQ checkpoint's own int4 groups (32: o_proj's and down_proj's shards are whole groups), cut."""
    gptq, ref = tmp_path / "gptq", tmp_path / "ref"
    gptq.mkdir(), ref.mkdir()
    write_gptq_checkpoint(tiny_model_dir, gptq, ref, 32, act_order=False)
    llm, _, _ = assert_tp_serves_as_tp1(gptq, mixed_adapters, {**KW, "quantization": "gptq", "max_lora_rank": 16},
                                   DORA_NAMES, 5)
    assert type(llm.engine.runner.model.layers[0].down.weight).__name__ == "Int4Weight"


def test_tp2_dora_matches_peft(tp_llm, tiny_model_dir, tiny_dora_adapters, peft_oracle):
    """The float32 oracle itself: each DoRA row's greedy tokens are transformers + peft's."""
    prompts = random_prompts(3, (3, 30), 512, seed=6)
    names = ["dora_r8_all", "dora_r16_rslora", "dora_r4_qv"]
    for name in names:
        tp_llm.add_adapter(name, tiny_dora_adapters[name])
    outs = tp_llm.generate(prompts, PARAMS, adapters=names)
    for prompt, name, out in zip(prompts, names, outs):
        assert out.token_ids == peft_oracle(tiny_model_dir, tiny_dora_adapters[name], prompt, PARAMS.max_tokens), name


def test_dead_worker_fails_the_step(tp_llm, tiny_adapters):
    worker = tp_llm.engine.runner.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=30)
    with pytest.raises(Exception):  # a broken pipe, or the gloo collective's error: not a hang
        tp_llm.generate([[5, 6, 7]], PARAMS)


@pytest.mark.parametrize("kw, line", [
    (dict(quantization="int4", int4_group_size=64), "int4 groups of 64 input channels do not split o_proj's 64"),
    (dict(tensor_parallel_size=3), "does not divide num_attention_heads"),
    (dict(lora_page_rows=8, fully_sharded_loras=True), "--fully-sharded-loras does not combine with --lora-page-rows"),
    (dict(fully_sharded_loras=True, max_lora_rank=9), "does not divide --max-lora-rank (9)"),
])
def test_unsharded_setups_refused(tiny_model_dir, kw, line):
    with pytest.raises(ModelConfigError, match=re.escape(line)):
        LLM(tiny_model_dir, **({**KW, "tensor_parallel_size": 2} | kw))


def test_fully_sharded_loras_needs_tensor_parallel(tiny_model_dir):
    with pytest.raises(ValueError, match="fully_sharded_loras needs tensor_parallel_size > 1"):
        LLM(tiny_model_dir, fully_sharded_loras=True, **KW)


def test_moe_base_with_fully_sharded_loras_refused(tmp_path):
    """An MoE base's expert LoRA is sharded as the default mode's only: the flag is refused, not ignored."""
    model_dir = make_moe_model(tmp_path / "mixtral", "mixtral")
    with pytest.raises(ModelConfigError, match=re.escape(
            "--fully-sharded-loras does not combine with an MoE base (MixtralForCausalLM) yet")):
        LLM(model_dir, tensor_parallel_size=2, fully_sharded_loras=True, **{**KW, "max_lora_rank": 16})
