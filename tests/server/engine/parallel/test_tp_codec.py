"""The tensor-parallel step pipe's wire format (server.engine.parallel.tp_codec): a real step's message
round-trips field for field, and bytes that are not a step message are refused, never executed."""
from __future__ import annotations

import dataclasses
import pickle

import msgspec
import pytest
import torch

from kernels.metadata import AttentionBatch, LoraBatch
from server.engine.parallel import tp_codec
from server.engine.parallel.tp_messages import TpStep, TpStop

pytestmark = pytest.mark.unit


def _step() -> TpStep:
    attn = AttentionBatch.build([[0, 1], [2, 3]], [0, 4], [3, 1], block_size=4, device="cpu")
    lora = LoraBatch.build([0, 0, 0, -1], device="cpu")
    windowed = AttentionBatch.build([[4], [5, 6]], [0, 4], [3, 1], block_size=4, device="cpu")  # a second KV group's
    return TpStep(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 4]), attn, lora, torch.tensor([2, 3]),
                  ((1, 3),), (attn, windowed))


def _same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            if f.compare:
                _same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def test_a_step_round_trips_field_for_field():
    step = _step()
    step.attn.scratch["cached"] = torch.ones(2)  # a per-step cache stays behind
    back = tp_codec.decode(tp_codec.encode(step))
    _same(step, back)
    assert back.attn.scratch == {}
    assert isinstance(tp_codec.decode(tp_codec.encode(TpStop())), TpStop)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int8, torch.bool])
def test_tensors_keep_dtype_shape_and_values(dtype):
    t = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    lora = dataclasses.replace(_step().lora, token_slots=t)
    _same(lora.token_slots, tp_codec.decode(tp_codec.encode(dataclasses.replace(_step(), lora=lora))).lora.token_slots)


def test_unknown_types_are_refused_both_ways():
    @dataclasses.dataclass(frozen=True)
    class Stranger:
        x: int = 1

    with pytest.raises(TypeError, match="Stranger is not a message type"):
        tp_codec.encode(dataclasses.replace(_step(), block_copies=(Stranger(),)))
    with pytest.raises(TypeError, match="no wire form for a type"):
        tp_codec.encode(dataclasses.replace(_step(), block_copies=(object,)))
    with pytest.raises(ValueError, match="not a message type"):
        tp_codec.decode(msgspec.msgpack.encode({"~class": ["Popen", {"args": "rm -rf /"}]}))
    with pytest.raises(ValueError, match="not a step message"):
        tp_codec.decode(msgspec.msgpack.encode({"~tuple": [1, 2]}))
    with pytest.raises(msgspec.DecodeError):
        tp_codec.decode(pickle.dumps(TpStop()))
