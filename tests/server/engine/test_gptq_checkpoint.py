"""A GPTQ 4-bit checkpoint in the Hugging Face layout, written here from the tiny model (asymmetric,
groups of 32 input channels, act-order g_idx), served dequantized: its weights are exactly the
writer's scale * (q - zero), and its tokens are transformers + peft's on those float weights.
Other formats are refused with what is supported."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from server.engine import LLM
from server.engine.config import ModelConfigError
from server.engine.gptq_checkpoint import checkpoint_quantization, dequantize_gptq
from tests.engine_helpers import assert_matches_peft, greedy, random_prompts
from tests.gptq_writer import write_gptq_checkpoint

pytestmark = pytest.mark.unit

VOCAB = 512
GROUP = 32


@pytest.fixture(scope="module")
def gptq_dirs(tiny_model_dir, tmp_path_factory):
    """(the GPTQ checkpoint, act-order, the float checkpoint of its dequantized weights: the oracle's)."""
    gptq, ref = tmp_path_factory.mktemp("tiny-gptq"), tmp_path_factory.mktemp("tiny-gptq-reference")
    write_gptq_checkpoint(tiny_model_dir, gptq, ref, GROUP, act_order=True)
    return gptq, ref


def test_the_loader_reads_back_the_writers_weights(gptq_dirs):
    gptq, ref = gptq_dirs
    tensors, expected = load_file(next(gptq.glob("*.safetensors"))), load_file(next(ref.glob("*.safetensors")))
    layer = "model.layers.1.mlp.down_proj"
    w = dequantize_gptq(*(tensors[f"{layer}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")), GROUP)
    assert w.shape == (64, 128) and torch.equal(w, expected[f"{layer}.weight"])
    # Without g_idx, channel i is in group i // group_size.
    plain = torch.arange(128, dtype=torch.int32) // GROUP
    assert torch.equal(dequantize_gptq(tensors[f"{layer}.qweight"], tensors[f"{layer}.qzeros"],
                                       tensors[f"{layer}.scales"], None, GROUP),
                       dequantize_gptq(tensors[f"{layer}.qweight"], tensors[f"{layer}.qzeros"],
                                       tensors[f"{layer}.scales"], plain, GROUP))


def test_a_gptq_checkpoint_serves_peft_tokens_on_its_dequantized_weights(gptq_dirs, tiny_adapters, peft_oracle):
    gptq, ref = gptq_dirs
    llm = LLM(gptq, device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=64, max_model_len=256)
    for name, path in tiny_adapters.items():
        llm.add_adapter(name, path)
    o_proj = load_file(next(ref.glob("*.safetensors")))["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(llm.engine.model.layers[0].o.weight, o_proj)
    names = [None, *tiny_adapters]
    prompts = random_prompts(len(names), (5, 30), VOCAB, seed=5)
    outs = llm.generate(prompts, greedy(6), adapters=names)
    assert_matches_peft(llm, ref, tiny_adapters, prompts, names, outs, 6, peft_oracle)


@pytest.mark.parametrize("qc", [
    {"quant_method": "awq", "bits": 4, "group_size": 128},
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
    {"quant_method": "compressed-tensors"},
    {"quant_method": "gptq", "bits": 8, "group_size": 128},
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"},
    "gptq",
])
def test_other_formats_are_refused_naming_what_is_supported(qc):
    with pytest.raises(ModelConfigError, match="supported: GPTQ 4-bit in the Hugging Face layout"):
        checkpoint_quantization({"quantization_config": qc})


def test_an_unsupported_checkpoint_fails_at_start(tiny_model_dir, tmp_path):
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ModelConfigError, match="checkpoint quantization 'awq'"):
        LLM(tmp_path, device="cpu", kv_cache_blocks=16, max_model_len=64)
