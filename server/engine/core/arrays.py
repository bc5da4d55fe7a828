"""Token ids and logprobs on the wire as packed native arrays (int32, float64): one bytes object
per field instead of one msgpack item per token. Both ends run on one machine, so native order."""
from __future__ import annotations

from array import array
from collections.abc import Iterable


def int_bytes(values: Iterable[int]) -> bytes:
    return array("i", values).tobytes()


def ints(data: bytes) -> list[int]:
    out = array("i")
    out.frombytes(data)
    return out.tolist()


def float_bytes(values: Iterable[float]) -> bytes:
    return array("d", values).tobytes()  # float64: the engine's logprobs round-trip exactly


def floats(data: bytes) -> list[float]:
    out = array("d")
    out.frombytes(data)
    return out.tolist()
