"""server/bench/quantized_peer_checkpoint.py: the quantized copy the vLLM peer serves holds exactly the
weights loraplex's `--quantization int8` computes from the float checkpoint, in compressed-tensors'
layouts (checked bit for bit on a hand-packed word), and GPTQ 4-bit that loraplex's own loader reads."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.int8_weights import dequantize_int8, quantize_int8
from server.bench.quantized_peer_checkpoint import (GPTQ_GROUP, QuantizedCheckpointError, is_projection, pack_int8,
                                                    quantization_config, read_dequantized, unpack_int8,
                                                    write_int8_reference, write_quantized_checkpoint)
from server.engine.gptq_checkpoint import checkpoint_quantization

pytestmark = pytest.mark.unit

HIDDEN, INTER = 128, 192


@pytest.fixture
def float_dir(tmp_path):
    """A one-layer Llama-shaped float checkpoint (weights only matter here), with a tokenizer file to copy."""
    d = tmp_path / "float"
    d.mkdir()
    gen = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    shapes = {p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (64, HIDDEN),
              p + "self_attn.v_proj.weight": (64, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
              p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
              p + "mlp.down_proj.weight": (HIDDEN, INTER), "model.embed_tokens.weight": (256, HIDDEN),
              p + "input_layernorm.weight": (HIDDEN,), "model.norm.weight": (HIDDEN,)}
    tensors = {k: torch.randn(*s, generator=gen) for k, s in shapes.items()}
    tensors[p + "mlp.up_proj.weight"][3] = 0.0  # an all-zero row keeps scale 1 and q 0
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": HIDDEN, "dtype": "float32"}))
    (d / "tokenizer.json").write_text("{}")
    return d


def test_projections_are_the_decoders_seven_only():
    assert is_projection("model.layers.3.self_attn.k_proj.weight")
    assert is_projection("model.layers.0.mlp.down_proj.weight")
    assert not is_projection("model.embed_tokens.weight")
    assert not is_projection("lm_head.weight")
    assert not is_projection("model.layers.0.input_layernorm.weight")
    assert not is_projection("model.layers.0.self_attn.q_proj.bias")


@pytest.mark.parametrize("kind", ["w8a8-int8", "w8a16-int8"])
def test_int8_copies_hold_loraplexs_own_quantized_weights(float_dir, tmp_path, kind):
    out = write_quantized_checkpoint(float_dir, tmp_path / kind, kind)
    src = load_file(float_dir / "model.safetensors")
    back = read_dequantized(out)
    assert set(back) == set(src)
    for key, w in src.items():
        if is_projection(key):
            assert torch.equal(back[key], dequantize_int8(quantize_int8(w))), key
        else:
            assert torch.equal(back[key], w), key  # embeddings and norms stay float, untouched
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == quantization_config(kind)
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    assert (out / "tokenizer.json").read_text() == "{}"
    stored = load_file(out / "model.safetensors")
    layer = "model.layers.0.mlp.up_proj"
    assert stored[f"{layer}.weight_scale"].shape == (INTER, 1)
    assert stored[f"{layer}.weight_scale"].dtype == torch.float32
    if kind == "w8a8-int8":
        assert stored[f"{layer}.weight"].dtype == torch.int8
        assert config["quantization_config"]["format"] == "int-quantized"
        assert config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"]
    else:
        assert stored[f"{layer}.weight_packed"].shape == (INTER, HIDDEN // 4)
        assert stored[f"{layer}.weight_shape"].tolist() == [INTER, HIDDEN]
        assert config["quantization_config"]["config_groups"]["group_0"]["input_activations"] is None


def test_int8_packing_is_compressed_tensors_layout_bit_for_bit():
    # q + 128 per byte, value j at bits 8j: [1, 2, 0, -127] -> 129 | 130 << 8 | 128 << 16 | 1 << 24
    word = pack_int8(torch.tensor([[1, 2, 0, -127]], dtype=torch.int8))
    assert word.tolist() == [[129 | 130 << 8 | 128 << 16 | 1 << 24]]
    # a top byte >= 128 wraps to a negative int32, as torch's int32 shift-and-sum does
    top = pack_int8(torch.tensor([[0, 0, 0, 127]], dtype=torch.int8))
    assert top.tolist() == [[(128 | 128 << 8 | 128 << 16 | 255 << 24) - 2**32]]
    q = torch.randint(-127, 128, (5, 16), generator=torch.Generator().manual_seed(1)).to(torch.int8)
    assert torch.equal(unpack_int8(pack_int8(q)), q)


def test_gptq_copy_is_read_by_loraplexs_loader_within_half_a_step(float_dir, tmp_path):
    out = write_quantized_checkpoint(float_dir, tmp_path / "gptq", "gptq-4bit")
    config = json.loads((out / "config.json").read_text())
    assert checkpoint_quantization(config).group_size == GPTQ_GROUP  # loraplex accepts the format
    src, back = load_file(float_dir / "model.safetensors"), read_dequantized(out)
    for key, w in src.items():
        if not is_projection(key):
            assert torch.equal(back[key], w)
            continue
        groups = w.reshape(w.shape[0], -1, GPTQ_GROUP)  # [out, G, group]
        step = (groups.abs().amax(dim=2, keepdim=True) / 7).half().float()  # the stored float16 scale
        err = (back[key].reshape(groups.shape) - groups).abs()
        # 7 levels above zero, 8 below: the largest positive value is exact up to the scale's rounding
        assert bool((err <= step / 2 + 1e-3 * step.clamp(min=1)).all()), key


def test_refusals_name_the_problem(float_dir, tmp_path):
    with pytest.raises(QuantizedCheckpointError, match="unknown peer quantization 'int4'"):
        write_quantized_checkpoint(float_dir, tmp_path / "x", "int4")
    out = write_quantized_checkpoint(float_dir, tmp_path / "q", "w8a8-int8")
    with pytest.raises(QuantizedCheckpointError, match="already quantized"):
        write_quantized_checkpoint(out, tmp_path / "qq", "w8a8-int8")


def test_a_complete_copy_is_reused_and_a_different_kind_rewritten(float_dir, tmp_path):
    out = tmp_path / "q"
    write_quantized_checkpoint(float_dir, out, "w8a8-int8")
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    write_quantized_checkpoint(float_dir, out, "w8a8-int8")
    assert weights.stat().st_mtime_ns == stamp
    write_quantized_checkpoint(float_dir, out, "w8a16-int8")
    assert "weight_packed" in "".join(load_file(weights))


def test_the_int8_reference_is_a_float_checkpoint_of_the_served_int8_weights(float_dir, tmp_path):
    out = write_int8_reference(float_dir, tmp_path / "ref")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    src, ref = load_file(float_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(ref) == set(src)
    for key, w in src.items():
        want = dequantize_int8(quantize_int8(w)) if is_projection(key) else w
        assert ref[key].dtype == w.dtype and torch.equal(ref[key], want), key
    assert torch.equal(ref["model.layers.0.mlp.up_proj.weight"], read_dequantized(
        write_quantized_checkpoint(float_dir, tmp_path / "q", "w8a8-int8"))["model.layers.0.mlp.up_proj.weight"])
