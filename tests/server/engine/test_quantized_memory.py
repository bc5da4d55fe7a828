"""Issue 42, item 7: after quantizing, no float copy of a quantized weight stays resident, and
/admin/engine's `base_weights` reports the weights' bytes by dtype, adding up."""
from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest
import torch

from kernels.int4_weights import Int4Weight
from kernels.int8_weights import Int8Weight
from server.demo import make_base_model
from server.engine import LLM
from server.engine.checkpoint_tensors import CheckpointTensors, read_index, read_tensor

# Widths no other tensor of the process has: a float tensor of a projection's shape is a projection.
HIDDEN, HEADS, KV_HEADS, INTER = 80, 5, 1, 176


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory):
    return make_base_model(tmp_path_factory.mktemp("odd-model"), "llama", hidden_size=HIDDEN, num_layers=2,
                           num_heads=HEADS, num_kv_heads=KV_HEADS, intermediate_size=INTER)


def projection_shapes() -> set[tuple[int, int]]:
    """Every projection's [out, in], unfused and fused (qkv, gate_up)."""
    q, kv = HIDDEN, HIDDEN // HEADS * KV_HEADS
    return {(q, HIDDEN), (kv, HIDDEN), (HIDDEN, q), (INTER, HIDDEN), (HIDDEN, INTER), (q + 2 * kv, HIDDEN),
            (2 * INTER, HIDDEN)}


def float_projections_alive() -> list[torch.Tensor]:
    """Float tensors of a projection's shape anywhere in this process (whoever holds them)."""
    gc.collect()
    shapes = projection_shapes()
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and o.is_floating_point() and tuple(o.shape) in shapes]


def reachable_tensors(root) -> list[torch.Tensor]:
    """The tensors reachable from root through attributes, containers and dataclass fields."""
    seen, found, todo = set(), [], [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("server", "kernels", "adapters"):
            todo += list(vars(obj).values())
    return found


def test_a_float_engine_holds_float_projections(odd_model_dir):
    """The walks' control: without quantization they find the fused projections."""
    llm = LLM(model=str(odd_model_dir), device="cpu", dtype="float32", kv_cache_blocks=16)
    shapes = projection_shapes()
    held = [t for t in reachable_tensors(llm) if t.is_floating_point() and tuple(t.shape) in shapes]
    assert len(held) >= 4 * 2 and float_projections_alive()
    del llm, held


@pytest.mark.parametrize("quantization, kind", [("int8", Int8Weight), ("int4", Int4Weight)])
def test_a_quantized_engine_holds_no_float_copy_of_a_projection(odd_model_dir, quantization, kind):
    llm = LLM(model=str(odd_model_dir), device="cpu", dtype="float32", kv_cache_blocks=16,
              quantization=quantization)
    model = llm.engine.model
    assert all(isinstance(lin.weight, kind) for layer in model.layers
               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    shapes = projection_shapes()
    assert not [tuple(t.shape) for t in reachable_tensors(llm) if t.is_floating_point() and tuple(t.shape) in shapes]
    assert not [tuple(t.shape) for t in float_projections_alive()]
    # The cause found in issue 42: safetensors' map of the checkpoint, kept alive by the embedding's
    # view of it, kept every float page read while quantizing in the process's RSS.
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(odd_model_dir / "model.safetensors") not in maps.read_text()
    view = model.base_weights()
    assert sum(view["bytes_by_dtype"].values()) == view["bytes"] == sum(t.nbytes for t in model.base_tensors())
    packed = "int8" if quantization == "int8" else "uint8"
    assert view["bytes_by_dtype"][packed] == sum(lin.weight.qweight.nbytes for layer in model.layers
                                                 for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    # float32: the embedding, lm_head and norms, and the projections' scales (and int4's offsets)
    floats = model.embed.nbytes + model.lm_head.nbytes + model.norm.weight.nbytes + sum(
        layer.input_norm.weight.nbytes + layer.post_norm.weight.nbytes for layer in model.layers) + sum(
        lin.weight.nbytes - lin.weight.qweight.nbytes
        for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert view["bytes_by_dtype"]["float32"] == floats


def test_checkpoint_tensors_read_what_safetensors_holds(odd_model_dir):
    from safetensors.torch import load_file

    path = odd_model_dir / "model.safetensors"
    expected = load_file(str(path))
    index = read_index(path)
    assert set(index) == set(expected)
    for key, t in expected.items():
        assert torch.equal(read_tensor(index[key]), t)
    lazy = CheckpointTensors(index, lambda t: t.to(torch.bfloat16))
    key = "model.norm.weight"
    assert lazy[key] is lazy[key] and lazy[key].dtype == torch.bfloat16  # kept once asked for
    assert key in lazy and len(lazy) == len(expected)
    proj = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(lazy.pop(proj), expected[proj].to(torch.bfloat16)) and proj not in lazy
    assert lazy.pop(proj, None) is None
    with pytest.raises(KeyError):
        lazy.pop(proj)


def test_admin_engine_reports_the_weights_bytes_by_dtype(tmp_path, odd_model_dir, redis_server):
    from tests.fixtures_server import api_redis_url, running_server, server_config

    # In-process: the bytes are checked against the model's own tensors, which stay in an engine core.
    config = server_config(odd_model_dir, tmp_path / "data", api_redis_url(redis_server), quantization="int8",
                           max_lora_rank=8, engine_process="in-process")
    with running_server(config) as server:
        _, key = server.new_tenant()
        server.client(key).completions.create(model=server.state.model_id, prompt=[5, 6, 7], max_tokens=4,
                                              temperature=0, extra_body={"ignore_eos": True})
        view = server.admin("GET", "/admin/engine").json()["base_weights"]
        assert view["projections"] == "int8" and view["lm_head"] == "float32"
        assert set(view["bytes_by_dtype"]) == {"float32", "int8"}
        assert sum(view["bytes_by_dtype"].values()) == view["bytes"]
        model = server.state.engine.engine.model
        assert view["bytes"] == sum(t.nbytes for t in model.base_tensors())
        assert view["bytes_by_dtype"]["int8"] < view["projection_bytes"] < view["bytes"]
