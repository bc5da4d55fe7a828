"""The tensor-parallel step pipe's wire format: msgpack (msgspec) of the step's dataclasses and tensors,
never pickle.

A message is a tree of the dataclasses named in MESSAGE_TYPES (a TpStep with its AttentionBatch and
LoraBatch, or a TpStop), tensors, dicts, tuples, lists and scalars. Encoding refuses anything else, so a
field of a new type fails the first step in a test instead of travelling by some other route; decoding
builds only the listed types. Fields declared with `compare=False` (per-step caches such as
AttentionBatch.scratch) stay behind: the worker's copy starts with the field's default, as rank 0's
did before the forward.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import torch

from kernels.metadata import AttentionBatch, AttentionLaunchPlan, LoraBatch, LoraLaunchPlan
from server.engine.parallel.tp_messages import TpStep, TpStop

MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in (TpStep, TpStop, AttentionBatch, LoraBatch,
                                                                 LoraLaunchPlan, AttentionLaunchPlan)}
_DTYPES: dict[str, torch.dtype] = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                                       torch.int32, torch.int16, torch.int8, torch.uint8,
                                                       torch.bool)}
# Tags of the non-msgpack kinds; a one-key dict whose key is one of these is never data of its own.
_TENSOR, _CLASS, _TUPLE, _DICT = "~tensor", "~class", "~tuple", "~dict"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode(message: TpStep | TpStop) -> bytes:
    return _encoder.encode(_to_wire(message))


def decode(data: bytes) -> TpStep | TpStop:
    message = _from_wire(_decoder.decode(data))
    if not isinstance(message, (TpStep, TpStop)):
        raise ValueError(f"tensor-parallel pipe: a {type(message).__name__} is not a step message")
    return message


def _to_wire(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        if t.dtype not in _DTYPES.values():
            raise TypeError(f"tensor-parallel pipe: no wire form for a {t.dtype} tensor")
        return {_TENSOR: [str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if MESSAGE_TYPES.get(name) is not type(value):
            raise TypeError(f"tensor-parallel pipe: {type(value).__qualname__} is not a message type")
        fields = {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value) if f.compare}
        return {_CLASS: [name, fields]}
    if isinstance(value, tuple):
        return {_TUPLE: [_to_wire(v) for v in value]}
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {_DICT: [[_to_wire(k), _to_wire(v)] for k, v in value.items()]}
    raise TypeError(f"tensor-parallel pipe: no wire form for a {type(value).__qualname__}")


def _from_wire(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_wire(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise ValueError("tensor-parallel pipe: a malformed message")
    tag, body = next(iter(value.items()))
    if tag == _TENSOR:
        dtype_name, shape, raw = body
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"tensor-parallel pipe: unknown dtype {dtype_name!r}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)
    if tag == _CLASS:
        name, fields = body
        cls = MESSAGE_TYPES.get(name)
        if cls is None:
            raise ValueError(f"tensor-parallel pipe: {name!r} is not a message type")
        return cls(**{k: _from_wire(v) for k, v in fields.items()})
    if tag == _TUPLE:
        return tuple(_from_wire(v) for v in body)
    if tag == _DICT:
        return {_from_wire(k): _from_wire(v) for k, v in body}
    raise ValueError(f"tensor-parallel pipe: unknown tag {tag!r}")
