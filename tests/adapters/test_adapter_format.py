"""adapters.format against real PEFT: adapters are built and saved with peft here,
and the parsed weights/scaling must equal what PEFT itself loads from disk."""
from __future__ import annotations

import json
import re
import struct
import warnings

import pytest
import safetensors.torch
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import LlamaConfig, LlamaForCausalLM

from adapters.format import (
    PROJECTIONS, AdapterFormatError, ModelShape, inspect_adapter_bytes, load_adapter_bytes, load_adapter_dir)
from adapters.medusa_format import ADAPTER_DIR, HeadWeights, save_heads
from adapters.packed import pack_adapter

pytestmark = pytest.mark.unit

HF_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100)
SHAPE = ModelShape(num_layers=2, hidden_size=32, q_size=32, kv_size=16, intermediate_size=64, vocab_size=100)
MAX_RANK = 16


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**HF_CONFIG))


def save_adapter(path, dtype=torch.float32, **lora_kwargs):
    """Build a randomly initialised PEFT LoRA on the tiny llama and save it; returns the dir."""
    torch.manual_seed(1)
    kwargs = dict(r=4, lora_alpha=8, target_modules=list(PROJECTIONS), init_lora_weights=False)
    kwargs.update(lora_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(tiny_llama(), LoraConfig(**kwargs)).to(dtype)
        model.save_pretrained(path)
    return path


def peft_reloaded(path) -> dict:
    """(layer, proj) -> (A, B, scaling) as PEFT itself loads the saved adapter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(tiny_llama(), path)
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
            m = re.search(r"layers\.(\d+)\.\w+\.(\w+_proj)$", name)
            out[(int(m[1]), m[2])] = (mod.lora_A["default"].weight.detach(),
                                      mod.lora_B["default"].weight.detach(), mod.scaling["default"])
    return out


def assert_matches_peft(adapter, expected: dict) -> None:
    assert set(adapter.weights) == set(expected)
    for slot, (a, b, scaling) in expected.items():
        w = adapter.weights[slot]
        assert w.a.dtype == torch.float32 and w.a.is_contiguous() and w.b.is_contiguous()
        assert torch.equal(w.a, a.float()), slot
        assert torch.equal(w.b, b.float()), slot
        assert w.scaling == scaling, (slot, w.scaling, scaling)
    assert adapter.rank == max(a.shape[0] for a, _, _ in expected.values())
    assert adapter.target_modules == tuple(sorted({p for _, p in expected}))
    assert adapter.size_bytes == 4 * sum(a.numel() + b.numel() for a, b, _ in expected.values())


def read(path):
    return (path / "adapter_config.json").read_bytes(), (path / "adapter_model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A rank-4 all-projection adapter: (dir, config dict, tensors dict)."""
    path = save_adapter(tmp_path_factory.mktemp("plain"))
    config, weights = read(path)
    return path, json.loads(config), safetensors.torch.load(weights)


def rebuild(config: dict, tensors: dict, **overrides) -> tuple[bytes, bytes]:
    return json.dumps({**config, **overrides}).encode(), safetensors.torch.save(tensors)


def raw_safetensors(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


# ---- equality with PEFT -----------------------------------------------------

VARIANTS = {
    "plain": dict(),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True),
    "rank_pattern": dict(rank_pattern={"v_proj": 2, "layers.1.self_attn.q_proj": 8, "down_proj": 6}),
    "alpha_pattern": dict(alpha_pattern={"k_proj": 3, "model.layers.0.mlp.up_proj": 32}),
    "both_patterns_rslora": dict(use_rslora=True, rank_pattern={"o_proj": 16}, alpha_pattern={"o_proj": 5}),
    "qv_only": dict(target_modules=["q_proj", "v_proj"]),
    "regex_targets": dict(target_modules=r".*\.(k_proj|gate_proj)"),
    "layers_to_transform": dict(layers_to_transform=[1]),
    "exclude_modules": dict(exclude_modules=["down_proj"]),
    # saved sorted, so on reload "layers.1..." comes first and wins for layer 1 (PEFT reloads it so too)
    "overlapping_alpha": dict(alpha_pattern={"q_proj": 3, "layers.1.self_attn.q_proj": 5}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_weights_and_scaling_equal_peft(tmp_path, variant):
    path = save_adapter(tmp_path, **VARIANTS[variant])
    adapter = load_adapter_dir(path, SHAPE, MAX_RANK)
    assert_matches_peft(adapter, peft_reloaded(path))
    assert adapter.use_rslora == VARIANTS[variant].get("use_rslora", False)


def test_overlapping_alpha_uses_saved_order(tmp_path):
    path = save_adapter(tmp_path, alpha_pattern={"q_proj": 3, "layers.1.self_attn.q_proj": 5})
    adapter = load_adapter_dir(path, SHAPE, MAX_RANK)
    assert adapter.weights[(0, "q_proj")].scaling == 3 / 4
    assert adapter.weights[(1, "q_proj")].scaling == 5 / 4


def test_bf16_weights_are_cast_to_float32(tmp_path):
    path = save_adapter(tmp_path, dtype=torch.bfloat16)
    header_dtypes = {str(t.dtype) for t in safetensors.torch.load(read(path)[1]).values()}
    assert header_dtypes == {"torch.bfloat16"}
    assert_matches_peft(load_adapter_dir(path, SHAPE, MAX_RANK), peft_reloaded(path))


def test_bytes_equal_dir_and_inspect_agrees(plain):
    path, _, _ = plain
    from_dir = load_adapter_dir(path, SHAPE, MAX_RANK)
    from_bytes = load_adapter_bytes(*read(path), SHAPE, MAX_RANK)
    summary = inspect_adapter_bytes(*read(path), SHAPE, MAX_RANK)
    assert set(from_bytes.weights) == set(from_dir.weights) and len(from_dir.weights) == 2 * len(PROJECTIONS)
    for slot, w in from_dir.weights.items():
        assert torch.equal(w.a, from_bytes.weights[slot].a) and torch.equal(w.b, from_bytes.weights[slot].b)
        assert w.scaling == from_bytes.weights[slot].scaling == 2.0
    expected = (4, tuple(sorted(PROJECTIONS)), from_bytes.size_bytes)
    assert (summary.rank, summary.target_modules, summary.size_bytes) == expected
    assert (from_dir.rank, from_dir.target_modules, from_dir.size_bytes) == expected
    assert from_dir.config["r"] == 4


def test_default_adapter_name_in_keys_is_accepted(plain):
    path, config, tensors = plain
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    adapter = load_adapter_bytes(*rebuild(config, renamed), SHAPE, MAX_RANK)
    assert torch.equal(adapter.weights[(1, "o_proj")].a,
                       tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"])


def test_model_shape_from_hf_config_and_in_out():
    assert ModelShape.from_hf_config(HF_CONFIG | {"num_hidden_layers": 2}) == SHAPE
    assert SHAPE.in_out("o_proj") == (32, 32) and SHAPE.in_out("k_proj") == (32, 16)
    assert SHAPE.in_out("down_proj") == (64, 32)
    with pytest.raises(ValueError, match="num_layers"):
        ModelShape(0, 32, 32, 16, 64)


# ---- refusals -----------------------------------------------------------------

def test_directory_refusals(tmp_path, plain):
    with pytest.raises(AdapterFormatError, match="no adapter_config.json"):
        load_adapter_dir(tmp_path, SHAPE, MAX_RANK)
    (tmp_path / "adapter_config.json").write_text(json.dumps(plain[1]))
    with pytest.raises(AdapterFormatError, match="no adapter_model.safetensors"):
        load_adapter_dir(tmp_path, SHAPE, MAX_RANK)
    # contents that would fail loudly if anything ever tried to unpickle them
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04never unpickled")
    with pytest.raises(AdapterFormatError, match="pickle .bin files are not loaded, save with safe_serialization"):
        load_adapter_dir(tmp_path, SHAPE, MAX_RANK)


CONFIG_REFUSALS = {
    "invalid JSON": None,
    "peft_type": dict(peft_type="IA3"),
    "has no lora_magnitude_vector, which use_dora=true needs": dict(use_dora=True),
    "use_dora must be true or false": dict(use_dora="yes"),
    "modules_to_save entry 'norm' selects model.norm: only embed_tokens and lm_head": dict(modules_to_save=["norm"]),
    "modules_to_save entry 'mlp' selects model.layers.0.mlp": dict(modules_to_save=["lm_head", "mlp"]),
    "modules_to_save entry 'vision_tower' matches no module": dict(modules_to_save=["vision_tower"]),
    "missing tensor: lm_head is in modules_to_save but has no weight": dict(modules_to_save=["lm_head"]),
    "bias=": dict(bias="all"),
    "lora_bias": dict(lora_bias=True),
    "fan_in_fan_out": dict(fan_in_fan_out=True),
    "modifies the base model": dict(init_lora_weights="pissa"),
    "missing tensors: model.embed_tokens is targeted": dict(target_modules=list(PROJECTIONS) + ["embed_tokens"]),
    "missing tensors: lm_head is targeted": dict(target_modules=list(PROJECTIONS) + ["lm_head"]),
    "'foo_proj' is not among": dict(target_modules=["q_proj", "foo_proj"]),
    "missing tensors: lm_head is targeted but has no lora_A": dict(target_modules=r".*(_proj|lm_head)"),
    "use_dora with LoRA on lm_head is not served": dict(target_modules=list(PROJECTIONS) + ["lm_head"], use_dora=True),
    "r must be a positive integer": dict(r=0),
    "lora_alpha must be a finite number": dict(lora_alpha="8"),
}


@pytest.mark.parametrize("reason", sorted(CONFIG_REFUSALS))
def test_config_refusals(plain, reason):
    _, config, tensors = plain
    overrides = CONFIG_REFUSALS[reason]
    config_json, weights = rebuild(config, tensors, **(overrides or {}))
    if overrides is None:
        config_json = config_json[:-3]
    with pytest.raises(AdapterFormatError, match=re.escape(reason)):
        load_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)
    with pytest.raises(AdapterFormatError, match=re.escape(reason)):
        inspect_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)


Q0_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q0_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def without(tensors, *keys):
    return {k: v for k, v in tensors.items() if k not in keys}


def test_rank_above_max_is_refused(plain):
    path, config, tensors = plain
    with pytest.raises(AdapterFormatError, match="rank 4, above max_lora_rank 2"):
        inspect_adapter_bytes(*read(path), SHAPE, 2)
    with pytest.raises(AdapterFormatError, match="above max_lora_rank 2"):
        load_adapter_dir(path, SHAPE, 2)


def test_shape_that_does_not_fit_the_model(plain):
    path, _, _ = plain
    wider = ModelShape(num_layers=2, hidden_size=48, q_size=48, kv_size=16, intermediate_size=64)
    with pytest.raises(AdapterFormatError, match=r"q_proj: shape mismatch .*in_features=48"):
        load_adapter_dir(path, wider, MAX_RANK)
    with pytest.raises(AdapterFormatError, match="layer 1 but the base model has 1 layers"):
        load_adapter_dir(path, ModelShape(1, 32, 32, 16, 64), MAX_RANK)
    with pytest.raises(AdapterFormatError, match="missing tensors: model.layers.2.self_attn.q_proj"):
        load_adapter_dir(path, ModelShape(3, 32, 32, 16, 64), MAX_RANK)


TENSOR_REFUSALS = {
    "model.layers.0.self_attn.q_proj has lora_A but no lora_B": lambda t: without(t, Q0_B),
    "model.layers.0.self_attn.q_proj has lora_B but no lora_A": lambda t: without(t, Q0_A),
    "missing tensors: model.layers.0.self_attn.q_proj is targeted": lambda t: without(t, Q0_A, Q0_B),
    "tensors for lm_head, which adapter_config.json does not target":
        lambda t: t | {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)},
    "a full lm_head weight, which modules_to_save does not name":
        lambda t: t | {"base_model.model.lm_head.weight": torch.zeros(100, 32)},
    "has a vocabulary of 120 rows but the base model's is 100: a resized vocabulary is not served":
        lambda t: t | {"base_model.model.model.embed_tokens.weight": torch.zeros(120, 32)},
    "q_proj has a lora_magnitude_vector (DoRA) but adapter_config.json does not set use_dora=true":
        lambda t: t | {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(32)},
    "q_proj is not under mlp": lambda t: t | {
        "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": torch.zeros(4, 32)},
    "has dtype I32; need a float dtype": lambda t: t | {Q0_A: t[Q0_A].to(torch.int32)},
    "rank 0": lambda t: t | {Q0_A: torch.zeros(0, 32), Q0_B: torch.zeros(32, 0)},
    "duplicate tensors": lambda t: t | {Q0_A.replace(".weight", ".default.weight"): t[Q0_A].clone()},
    "need 2 dimensions": lambda t: t | {Q0_A: t[Q0_A].reshape(4, 32, 1)},
}


@pytest.mark.parametrize("reason", sorted(TENSOR_REFUSALS))
def test_tensor_refusals(plain, reason):
    _, config, tensors = plain
    config_json, weights = rebuild(config, TENSOR_REFUSALS[reason](tensors))
    with pytest.raises(AdapterFormatError, match=re.escape(reason)):
        load_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)


def test_tensors_must_agree_with_config(plain):
    _, config, tensors = plain
    # config rank differs from the tensors' rank
    with pytest.raises(AdapterFormatError, match="have rank 4/4 .* gives r=8"):
        load_adapter_bytes(*rebuild(config, tensors, r=8), SHAPE, MAX_RANK)
    with pytest.raises(AdapterFormatError, match="gives r=2 for this module"):
        load_adapter_bytes(*rebuild(config, tensors, rank_pattern={"layers.1.mlp.up_proj": 2}), SHAPE, MAX_RANK)
    # tensors for a projection the config does not target
    with pytest.raises(AdapterFormatError, match="model.layers.0.self_attn.k_proj, which adapter_config.json "
                                                 "does not target"):
        load_adapter_bytes(*rebuild(config, tensors, target_modules=["q_proj", "v_proj"]), SHAPE, MAX_RANK)
    with pytest.raises(AdapterFormatError, match="layers.0.self_attn.q_proj, which adapter_config.json"):
        load_adapter_bytes(*rebuild(config, tensors, layers_to_transform=[1]), SHAPE, MAX_RANK)


def test_overlapping_rank_pattern_is_refused_like_peft(tmp_path):
    # In memory "q_proj" wins (rank 2 everywhere); the saved JSON is key-sorted, so on
    # reload layer 1's q_proj gets rank 8 and its rank-2 tensors no longer fit.
    path = save_adapter(tmp_path, rank_pattern={"q_proj": 2, "layers.1.self_attn.q_proj": 8})
    with pytest.raises(AdapterFormatError, match=r"layers.1.self_attn.q_proj: tensors have rank 2/2 .* r=8"):
        load_adapter_dir(path, SHAPE, MAX_RANK)
    with pytest.raises(RuntimeError, match="size mismatch"):
        peft_reloaded(path)


def test_size_limit(plain):
    path, _, _ = plain
    size = inspect_adapter_bytes(*read(path), SHAPE, MAX_RANK).size_bytes
    assert load_adapter_bytes(*read(path), SHAPE, MAX_RANK, max_bytes=size).size_bytes == size
    with pytest.raises(AdapterFormatError, match=f"adapter size {size} bytes .* above the limit of {size - 1}"):
        load_adapter_bytes(*read(path), SHAPE, MAX_RANK, max_bytes=size - 1)


def test_corrupt_safetensors(plain):
    path, config, tensors = plain
    config_json, weights = read(path)
    a_bytes = tensors[Q0_A].numpy().tobytes()
    cases = {
        "truncated": weights[:-10],
        "too short for the 8-byte header length": weights[:5],
        "above the 16777216-byte limit": struct.pack("<Q", 2 ** 62) + weights[8:],
        "not valid UTF-8 JSON": struct.pack("<Q", 6) + b"{nope}",
        "trailing bytes": weights + b"\0" * 4,
        "overlaps the previous tensor": raw_safetensors(
            {Q0_A: dict(dtype="F32", shape=[4, 32], data_offsets=[0, 512]),
             Q0_B: dict(dtype="F32", shape=[32, 4], data_offsets=[256, 768])}, a_bytes * 2),
        "needs 512": raw_safetensors({Q0_A: dict(dtype="F32", shape=[4, 32], data_offsets=[0, 500])},
                                     a_bytes[:500]),
    }
    dup = b'{"x": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, ' \
          b'"x": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}'
    cases["duplicate key"] = struct.pack("<Q", len(dup)) + dup
    for reason, bad in cases.items():
        with pytest.raises(AdapterFormatError, match=re.escape(reason)):
            inspect_adapter_bytes(config_json, bad, SHAPE, MAX_RANK)
        with pytest.raises(AdapterFormatError, match="corrupt safetensors"):
            load_adapter_bytes(config_json, bad, SHAPE, MAX_RANK)


# ---- DoRA -----------------------------------------------------------------------

Q0_M = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
K1_M = "base_model.model.model.layers.1.self_attn.k_proj.lora_magnitude_vector"


def peft_magnitudes(path) -> dict:
    """(layer, proj) -> DoRA magnitude vector [out], as PEFT itself loads the saved adapter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(tiny_llama(), path)
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.lora_magnitude_vector:
            m = re.search(r"layers\.(\d+)\.\w+\.(\w+_proj)$", name)
            out[(int(m[1]), m[2])] = mod.lora_magnitude_vector["default"].weight.detach()
    return out


DORA_VARIANTS = {
    "all": dict(),
    "qv_only": dict(target_modules=["q_proj", "v_proj"]),
    "rslora_patterns": dict(use_rslora=True, rank_pattern={"o_proj": 2}, alpha_pattern={"v_proj": 3}),
}


@pytest.mark.parametrize("variant", sorted(DORA_VARIANTS))
def test_dora_weights_and_magnitudes_equal_peft(tmp_path, variant):
    path = save_adapter(tmp_path, use_dora=True, **DORA_VARIANTS[variant])
    adapter = load_adapter_dir(path, SHAPE, MAX_RANK)
    expected = peft_reloaded(path)
    magnitudes = peft_magnitudes(path)
    assert adapter.use_dora and set(magnitudes) == set(expected) == set(adapter.weights)
    for slot, (a, b, scaling) in expected.items():
        w = adapter.weights[slot]
        assert torch.equal(w.a, a) and torch.equal(w.b, b) and w.scaling == scaling, slot
        assert w.magnitude.dtype == torch.float32 and torch.equal(w.magnitude, magnitudes[slot]), slot
    # Memory accounting counts the magnitude vectors (one float32 per output feature) too.
    assert adapter.size_bytes == 4 * sum(a.numel() + b.numel() + b.shape[0] for a, b, _ in expected.values())
    assert inspect_adapter_bytes(*read(path), SHAPE, MAX_RANK).size_bytes == adapter.size_bytes
    from_bytes = load_adapter_bytes(*read(path), SHAPE, MAX_RANK)
    assert all(torch.equal(w.magnitude, from_bytes.weights[s].magnitude) for s, w in adapter.weights.items())


@pytest.fixture(scope="module")
def dora(tmp_path_factory):
    """A rank-4 all-projection DoRA adapter: (dir, config dict, tensors dict)."""
    path = save_adapter(tmp_path_factory.mktemp("dora"), use_dora=True)
    config, weights = read(path)
    return path, json.loads(config), safetensors.torch.load(weights)


def test_dora_default_adapter_name_in_keys_is_accepted(dora):
    _, config, tensors = dora
    renamed = {k + ".default.weight" if k.endswith("magnitude_vector") else k: v for k, v in tensors.items()}
    adapter = load_adapter_bytes(*rebuild(config, renamed), SHAPE, MAX_RANK)
    assert torch.equal(adapter.weights[(0, "q_proj")].magnitude, tensors[Q0_M])


DORA_REFUSALS = {
    # shapes, from the header alone (inspect refuses them too)
    "lora_magnitude_vector has shape [33], must be [32] (out_features)":
        lambda t: t | {Q0_M: torch.ones(33)},
    "k_proj: lora_magnitude_vector has shape [32], must be [16]": lambda t: t | {K1_M: torch.ones(32)},
    "has shape [32, 1]; need 1 dimension": lambda t: t | {Q0_M: torch.ones(32, 1)},
    "has no lora_magnitude_vector, which use_dora=true needs": lambda t: without(t, Q0_M),
    "duplicate tensors": lambda t: t | {Q0_M + ".default.weight": t[Q0_M].clone()},
    # values, once materialised
    "lora_magnitude_vector holds nan": lambda t: t | {Q0_M: torch.full((32,), float("nan"))},
    "lora_magnitude_vector holds inf": lambda t: t | {Q0_M: t[Q0_M].index_fill(0, torch.tensor([3]), float("inf"))},
    "lora_magnitude_vector holds a value of magnitude 1e+38": lambda t: t | {Q0_M: torch.full((32,), -1e38)},
}


@pytest.mark.parametrize("reason", sorted(DORA_REFUSALS))
def test_dora_refusals(dora, reason):
    _, config, tensors = dora
    config_json, weights = rebuild(config, DORA_REFUSALS[reason](tensors))
    with pytest.raises(AdapterFormatError, match=re.escape(reason)):
        load_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)
    if "holds" not in reason:
        with pytest.raises(AdapterFormatError, match=re.escape(reason)):
            inspect_adapter_bytes(config_json, weights, SHAPE, MAX_RANK)


def test_an_adapters_own_medusa_heads_count_in_its_size_bytes_packed_or_not(tmp_path):
    """The host tier budgets adapters by size_bytes: an adapter's heads are part of what it holds."""
    path = save_adapter(tmp_path / "a")
    plain = load_adapter_dir(path, SHAPE, MAX_RANK)
    heads = HeadWeights(torch.randn(3, 32, 32), torch.randn(3, 32))
    save_heads(path / ADAPTER_DIR, heads, SHAPE.vocab_size)
    with_heads = load_adapter_dir(path, SHAPE, MAX_RANK)
    assert with_heads.medusa is not None and with_heads.size_bytes == plain.size_bytes + heads.nbytes
    packed, packed_plain = (pack_adapter(a, torch.float16, pin=False) for a in (with_heads, plain))
    assert packed.medusa is with_heads.medusa and packed.size_bytes == packed_plain.size_bytes + heads.nbytes
