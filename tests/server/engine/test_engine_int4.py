"""`quantization="int4"`: GPTQ's groupwise 4-bit arithmetic (kernels.int4_weights) from a float checkpoint
(round-to-nearest) or a GPTQ checkpoint's own 4-bit values, the int4 matmuls against the dequantized
product, and the engine against transformers + peft run on exactly the same dequantized weights: greedy
tokens identical for mixed adapters and base rows, logprobs within the issue's 1e-3."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.cpu_linear import cpu_flags
from kernels.int4_avx2 import avx2_int4_linear_or_none
from kernels.int4_weights import (Int4Weight, cat_int4, dequant_int4_linear, dequantize_int4, int4_linear_for,
                                  pack_nibbles, quantize_int4, unpack_nibbles)
from server.cli import build_parser
from server.config import ConfigError, ServerConfig
from server.engine import LLM, SamplingParams
from server.engine.config import EngineConfig, ModelConfigError
from tests.engine_helpers import (GREEDY, assert_matches_peft, generate_in_one_batch,
                                   generate_through_preemption_and_prefix_hits, random_prompts)
from tests.gptq_writer import PROJECTIONS, write_gptq_checkpoint
from tests.server.engine.test_engine_int8 import max_logprob_gap

VOCAB = 512
LOGPROB_TOL = 1e-3  # the target for a quantized base
CPU = torch.device("cpu")
AVX2 = avx2_int4_linear_or_none(cpu_flags())  # None without AVX2 + FMA or a compiler
needs_avx2 = pytest.mark.skipif(AVX2 is None, reason="no AVX2 + FMA on this CPU, or no C++ compiler")


def test_nibbles_round_trip():
    q = torch.randint(0, 16, (5, 48), generator=torch.Generator().manual_seed(0))
    packed = pack_nibbles(q)
    assert packed.shape == (5, 24) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 1]) << 4  # channel 2j low, 2j + 1 high
    assert torch.equal(unpack_nibbles(packed), q.to(torch.uint8))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_round_trip_error_is_at_most_half_a_step(group):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 208, generator=g) * torch.logspace(-4, 1, 40)[:, None]  # rows of very different ranges
    w[3] = 0.0  # a constant group must not divide by zero
    w[5] = w[5].abs() + 0.1  # all positive: the range is the group's own, not stretched to 0
    q = quantize_int4(w, group)
    groups = -(-208 // group)  # the last group is short unless group divides 208
    assert q.scale.shape == q.offset.shape == (40, groups)
    deq = dequantize_int4(q)
    gi = torch.arange(208) // group
    step = q.scale[:, gi]  # [out, in]
    assert torch.all((deq - w).abs() <= step / 2 * (1 + 1e-5) + 1e-6 * w.abs())
    assert torch.all(deq[3] == 0)
    assert torch.all(q.offset[5] >= 0.1)  # the group's minimum, not 0
    # each group's extremes are exact: q 0 is its minimum, q 15 lands on its maximum (up to rounding)
    lo = torch.stack([w[:, gi == j].amin(dim=1) for j in range(groups)], dim=1)
    assert torch.equal(q.offset, lo)


def test_a_q4_1_model_is_reproduced_by_groups_of_its_blocks():
    """Weights that are already s q + m per block of 32 (GGUF Q4_1, as the default model's) come back
    within float rounding: the quantizer finds each block's own grid."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (24, 96), generator=g).float()
    q[:, ::32], q[:, 1::32] = 0, 15  # each block uses its whole range, as Q4_1's quantizer makes it
    d = (torch.rand(24, 3, generator=g) * 0.05 + 1e-3).half().float().repeat_interleave(32, dim=1)
    m = (-torch.rand(24, 3, generator=g) * 0.3).half().float().repeat_interleave(32, dim=1)
    w = d * q + m
    again = dequantize_int4(quantize_int4(w, 32))
    assert (again - w).abs().max() <= 1e-6 * w.abs().max()


def test_fused_quantization_equals_per_projection():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(32, 96, generator=g), torch.randn(16, 96, generator=g) * 5
    fused, parts = quantize_int4(torch.cat([a, b]), 32), cat_int4([quantize_int4(a, 32), quantize_int4(b, 32)])
    for field in ("qweight", "scale", "offset"):
        assert torch.equal(getattr(fused, field), getattr(parts, field))


def test_widths_and_groups_the_kernels_cannot_take_are_refused():
    with pytest.raises(ValueError, match="multiples of 16, got 72"):
        quantize_int4(torch.randn(4, 72))
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        quantize_int4(torch.randn(4, 96), 48)


MATMULS = {"dequant": dequant_int4_linear, "avx2": AVX2}


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 40])  # past 16 rows the AVX2 kernel unpacks, then GEMMs
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_matmul_equals_the_dequantized_matmul(matmul, rows, group, bias):
    if MATMULS[matmul] is None:
        pytest.skip("no AVX2 + FMA on this CPU, or no C++ compiler")
    int4_linear = MATMULS[matmul]
    g = torch.Generator().manual_seed(rows * group)
    w = quantize_int4(torch.randn(70, 208, generator=g), group)  # ragged: 70 rows, 208 = 1.625 groups of 128
    w.offset[0, 0] = -16 * w.scale[0, 0]  # a GPTQ checkpoint's largest zero, 16
    x = torch.randn(rows, 208, generator=g)
    b = torch.randn(70, generator=g) if bias else None
    ref = x.double() @ dequantize_int4(w).double().t() + (0 if b is None else b.double())  # [T, out]
    y = int4_linear(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (rows, 70)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    out = torch.full((rows, 70), float("nan"))
    assert int4_linear(x, w, b, out=out) is out and torch.equal(out, y)
    stale = torch.full((70 * 208 + 3,), float("nan"))  # the workspace's scratch, last used by another weight
    assert torch.equal(int4_linear(x, w, b, scratch=stale), y)
    strided = torch.randn(208, rows, generator=g).t()  # [T, in], not contiguous
    assert torch.allclose(int4_linear(strided, w), strided @ dequantize_int4(w).t(), atol=1e-4)


@needs_avx2
def test_the_avx2_kernel_checks_its_operands():
    w = quantize_int4(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="avx2_int4_linear takes"):
        AVX2(torch.randn(2, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="avx2_int4_linear takes"):
        AVX2(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="avx2_int4_linear takes"):
        AVX2(torch.randn(2, 64), w, out=torch.empty(2, 9))


def test_the_choice_per_device_and_dtype():
    assert int4_linear_for(torch.device("cuda", 0)) is dequant_int4_linear  # the Triton kernel set has its own
    assert int4_linear_for(CPU, torch.bfloat16, frozenset({"avx2", "fma"})) is dequant_int4_linear
    assert int4_linear_for(CPU, torch.float32, frozenset({"avx2"})) is dequant_int4_linear  # no FMA
    assert int4_linear_for(CPU, torch.float32, frozenset({"avx2", "fma"}), compiler="no-such-cc") is dequant_int4_linear
    if AVX2 is not None:
        assert int4_linear_for(CPU, torch.float32, frozenset({"avx2", "fma"})).__name__ == "avx2_int4_linear"


def write_int4_reference(model_dir, out):
    """`model_dir` with every decoder projection replaced by dequantize(quantize_int4(w)): the oracle's
    weights for a float checkpoint served with quantization "int4" (groups of 32, the default)."""
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    for f in model_dir.glob("*.safetensors"):
        tensors = load_file(f)
        for key, w in tensors.items():
            if key.endswith(".weight") and key.split(".")[-2] in PROJECTIONS:
                tensors[key] = dequantize_int4(quantize_int4(w), w.dtype).contiguous()
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def int4_reference_dir(tiny_model_dir, tmp_path_factory):
    return write_int4_reference(tiny_model_dir, tmp_path_factory.mktemp("tiny-int4-reference"))


@pytest.fixture(scope="module", params=MATMULS)
def llm(request, tiny_model_dir, tiny_adapters):
    """The int4 engine with each CPU matmul (the AVX2 kernel where this CPU has AVX2 + FMA)."""
    if MATMULS[request.param] is None:
        pytest.skip("no AVX2 + FMA on this CPU, or no C++ compiler")
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=256, max_model_len=512,
              quantization="int4")
    engine = llm.engine
    engine.kernels = dataclasses.replace(engine.kernels, int4_linear=MATMULS[request.param])
    engine.runner.ops = engine.kernels
    for name, path in tiny_adapters.items():
        llm.add_adapter(name, path)
    return llm


def stored_projections(llm) -> list:
    return [w for layer in llm.engine.model.layers
            for w in (layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight)]


def test_base_projection_weights_are_stored_in_int4(llm, tiny_model_dir):
    float32_bytes = sum(w.float().nbytes for f in tiny_model_dir.glob("*.safetensors")
                        for k, w in load_file(f).items() if k.split(".")[-2] in PROJECTIONS)
    stored = stored_projections(llm)
    assert all(isinstance(w, Int4Weight) and w.group_size == 32 for w in stored)
    assert sum(w.nbytes for w in stored) <= 0.19 * float32_bytes  # 0.5 B per weight + 8 B per group of 32


def test_mixed_adapters_and_base_rows_match_quantized_peft(llm, int4_reference_dir, tiny_adapters, peft_oracle):
    names = [None, *tiny_adapters] * 4  # 20 requests: 4 adapters of ranks 4..32 plus base rows
    prompts = random_prompts(len(names), (3, 40), VOCAB, seed=1)
    outs = generate_in_one_batch(llm, prompts, names, SamplingParams(max_tokens=8, logprobs=0, **GREEDY))
    assert_matches_peft(llm, int4_reference_dir, tiny_adapters, prompts, names, outs, 8, peft_oracle)
    assert max_logprob_gap(int4_reference_dir, tiny_adapters, prompts, names, outs) <= LOGPROB_TOL
    assert max_logprob_gap(llm.engine.config.model, tiny_adapters, prompts, names, outs) > 1e-3  # 4 bits show


def test_preemption_and_prefix_hits_match_quantized_peft(tiny_model_dir, tiny_adapters, int4_reference_dir,
                                                         peft_oracle):
    """int4 projections through preemption (8 sequences of ~50 + 24 tokens in 18 blocks of 16) and
    prefix-cache hits (a shared 33-token prefix): still the quantized oracle's tokens."""
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_loras=2, kv_cache_blocks=18, max_model_len=128,
              quantization="int4")
    adapters = {n: tiny_adapters[n] for n in ("r8_all", "r4_qv")}
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    prompts, names, outs = generate_through_preemption_and_prefix_hits(llm, VOCAB)
    assert_matches_peft(llm, int4_reference_dir, adapters, prompts, names, outs, 24, peft_oracle)
    assert max_logprob_gap(int4_reference_dir, adapters, prompts, names, outs) <= LOGPROB_TOL


@pytest.fixture(scope="module")
def gptq_dirs(tiny_model_dir, tmp_path_factory):
    """A GPTQ checkpoint without act-order (groups of 32), and the float checkpoint of its weights."""
    gptq, ref = tmp_path_factory.mktemp("tiny-gptq-int4"), tmp_path_factory.mktemp("tiny-gptq-int4-reference")
    write_gptq_checkpoint(tiny_model_dir, gptq, ref, 32, act_order=False, seed=3)
    return gptq, ref


def test_a_gptq_checkpoint_is_served_in_its_own_4_bits(gptq_dirs, tiny_adapters, peft_oracle):
    """No requantization: each served int4 weight dequantizes to exactly the checkpoint's float weight,
    and the tokens are transformers + peft's on those weights, with adapters."""
    gptq, ref = gptq_dirs
    llm = LLM(gptq, device="cpu", dtype="float32", max_loras=4, kv_cache_blocks=64, max_model_len=256,
              quantization="int4")
    expected = load_file(next(ref.glob("*.safetensors")))
    layer = llm.engine.model.layers[1]
    assert isinstance(layer.o.weight, Int4Weight) and layer.o.weight.group_size == 32
    assert torch.equal(dequantize_int4(layer.o.weight), expected["model.layers.1.self_attn.o_proj.weight"])
    qkv = torch.cat([expected[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(dequantize_int4(layer.qkv.weight), qkv)  # fused in 4 bits
    for name, path in tiny_adapters.items():
        llm.add_adapter(name, path)
    names = [None, *tiny_adapters] * 2
    prompts = random_prompts(len(names), (5, 30), VOCAB, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, logprobs=0, **GREEDY), adapters=names)
    assert_matches_peft(llm, ref, tiny_adapters, prompts, names, outs, 6, peft_oracle)
    assert max_logprob_gap(ref, tiny_adapters, prompts, names, outs) <= LOGPROB_TOL


def test_an_act_order_gptq_checkpoint_is_refused_in_int4(tiny_model_dir, tmp_path):
    gptq, ref = tmp_path / "gptq", tmp_path / "ref"
    gptq.mkdir()
    ref.mkdir()
    write_gptq_checkpoint(tiny_model_dir, gptq, ref, 32, act_order=True)
    with pytest.raises(ModelConfigError, match="act-order"):
        LLM(gptq, device="cpu", kv_cache_blocks=16, max_model_len=64, quantization="int4")
    config = json.loads((gptq / "config.json").read_text())
    assert config["quantization_config"]["desc_act"] is True


def test_int4_is_served_on_the_cpu_and_the_gpu(tiny_model_dir):
    config = EngineConfig.of(model=str(tiny_model_dir), quantization="int4")
    for device in (torch.device("cuda", 0), CPU):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            config.quantization.check_device(device, dtype, capability=(8, 0))
    with pytest.raises(ValueError, match="quantize_lm_head needs quantization 'int8'"):
        EngineConfig.of(model=str(tiny_model_dir), quantization="int4", quantize_lm_head=True)


def test_cli_flags_reach_the_server_config(tmp_path):
    parser = build_parser()
    base = ["serve", "--data-dir", str(tmp_path), "--admin-token", "x" * 16]
    config = ServerConfig.from_args(parser.parse_args(base + ["--quantization", "int4"]), env={}).engine
    assert config.quantization.quantization == "int4" and config.quantization.int4_group_size is None
    grouped = base + ["--quantization", "int4", "--int4-group-size", "32"]
    quant = ServerConfig.from_args(parser.parse_args(grouped), env={}).engine.quantization
    assert quant.int4_group_size == 32
    for argv, message in ((base + ["--int4-group-size", "32"], "--int4-group-size needs --quantization 'int4'"),
                          (base + ["--quantization", "int4", "--int4-group-size", "48"], "multiple of 32, got 48")):
        with pytest.raises(ConfigError, match=message):
            ServerConfig.from_args(parser.parse_args(argv), env={})


def test_a_group_size_is_honoured_or_refused(tiny_model_dir, gptq_dirs):
    with pytest.raises(ValueError, match="int4_group_size needs quantization 'int4'"):
        EngineConfig.of(model=str(tiny_model_dir), quantization="int8", int4_group_size=64)
    with pytest.raises(ValueError, match="multiple of 32, got 40"):
        EngineConfig.of(model=str(tiny_model_dir), quantization="int4", int4_group_size=40)
    llm = LLM(tiny_model_dir, device="cpu", kv_cache_blocks=16, max_model_len=64, quantization="int4",
              int4_group_size=64)
    assert {w.group_size for w in stored_projections(llm)} == {64}
    assert llm.engine.model.layers[0].down.weight.scale.shape == (64, 2)  # 128 inputs in groups of 64
    with pytest.raises(ModelConfigError, match="GPTQ checkpoint with groups of 32, served as they are"):
        LLM(gptq_dirs[0], device="cpu", kv_cache_blocks=16, max_model_len=64, quantization="int4",
            int4_group_size=64)


def test_a_server_started_with_int4_serves_the_quantized_model(tmp_path, tiny_model_dir, int4_reference_dir,
                                                               redis_server, peft_oracle):
    from tests.fixtures_server import api_redis_url, running_server, server_config

    # In-process: the test reads the served model's weight types and stored projections.
    config = server_config(tiny_model_dir, tmp_path / "data", api_redis_url(redis_server), quantization="int4",
                           engine_process="in-process")
    with running_server(config) as server:
        engine = server.state.engine.engine
        assert isinstance(engine.model.layers[0].gate_up.weight, Int4Weight)
        view = server.admin("GET", "/admin/engine").json()["base_weights"]
        assert view["projections"] == "int4" and view["int4_group_size"] == 32 and view["lm_head"] == "float32"
        assert view["projection_bytes"] == sum(w.nbytes for w in stored_projections(server.state.engine))
        if AVX2 is not None:  # the engine's own choice here
            assert engine.kernels.int4_linear.__name__ == "avx2_int4_linear"
        _, key = server.new_tenant()
        ids = random_prompts(1, (10, 10), VOCAB, seed=6)[0]
        r = server.client(key).completions.create(model=server.state.model_id, prompt=ids, max_tokens=8,
                                                   temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == engine.tokenizer.decode(peft_oracle(int4_reference_dir, None, ids, 8))


@pytest.mark.parametrize("name", ["gptq", "gptq_marlin"])
def test_vllms_gptq_names_serve_a_gptq_checkpoint_in_int4_and_refuse_a_float_one(name, gptq_dirs, tiny_model_dir,
                                                                                  tmp_path):
    config = EngineConfig.of(model=str(gptq_dirs[0]), quantization=name)
    assert config.quantization.quantization == "int4" and config.quantization.require_gptq_checkpoint
    llm = LLM(gptq_dirs[0], device="cpu", kv_cache_blocks=16, max_model_len=64, quantization=name)
    assert {w.group_size for w in stored_projections(llm)} == {32}  # the checkpoint's own groups
    with pytest.raises(ModelConfigError, match="--quantization gptq serves a GPTQ checkpoint's own 4-bit weights"):
        LLM(tiny_model_dir, device="cpu", kv_cache_blocks=16, max_model_len=64, quantization=name)
    parser = build_parser()
    argv = ["serve", "--data-dir", str(tmp_path), "--admin-token", "x" * 16, "--quantization", name]
    quant = ServerConfig.from_args(parser.parse_args(argv), env={}).engine.quantization  # vLLM's name, read as int4
    assert quant.quantization == "int4" and quant.require_gptq_checkpoint
