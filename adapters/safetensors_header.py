"""Bounded parsing of a safetensors header, before any tensor is allocated.

A safetensors file is an 8-byte little-endian header length N, N bytes of
JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}`, then the data section. Uploads are untrusted, so everything the
loader will later trust (shapes, byte ranges, total size) is checked here
against the real buffer length; only then does `safetensors` materialise.
The rules mirror the reference implementation's `validate`: tensors tile the
data section exactly, with no gap, overlap or trailing bytes.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from adapters.bounded_json import JsonLimitError, loads_bounded

# Far above any real adapter header (a 7B all-projection adapter needs ~60 KiB)
# yet small enough that a hostile length cannot make us allocate much.
MAX_HEADER_BYTES = 16 * 1024 * 1024

DTYPE_BYTES = MappingProxyType({
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
})


class SafetensorsHeaderError(ValueError):
    """The bytes are not a well-formed safetensors file; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int              # byte offset inside the data section
    end: int                # exclusive

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    data_start: int         # absolute offset of the data section (8 + N)
    total_bytes: int        # length of the whole file / buffer


def header_from_bytes(buf: bytes | bytearray | memoryview) -> SafetensorsHeader:
    view = memoryview(buf)
    length = _header_length(bytes(view[:8]), len(view))
    return _parse(bytes(view[8:8 + length]), len(view))


def header_from_file(path: str | os.PathLike) -> SafetensorsHeader:
    """Reads only the 8-byte prefix and the header, never the data section."""
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        length = _header_length(f.read(8), total)
        return _parse(f.read(length), total)


def _header_length(prefix: bytes, total: int) -> int:
    if len(prefix) < 8:
        raise SafetensorsHeaderError(f"truncated: {total} bytes is too short for the 8-byte header length")
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER_BYTES:
        raise SafetensorsHeaderError(f"header length {length} is above the {MAX_HEADER_BYTES}-byte limit")
    if 8 + length > total:
        raise SafetensorsHeaderError(f"truncated: header claims {length} bytes but only {total - 8} follow")
    return length


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsHeaderError(f"duplicate key {key!r} in header")
        out[key] = value
    return out


def _parse(raw: bytes, total: int) -> SafetensorsHeader:
    if not raw.startswith(b"{"):
        raise SafetensorsHeaderError("header does not start with '{' (not a safetensors file?)")
    try:
        # Bounded: the header is attacker-controlled (nesting, 5,000-digit
        # offsets, NaN, lone surrogates all end here, not in a 500).
        doc = loads_bounded(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, JsonLimitError) as e:
        raise SafetensorsHeaderError(f"header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(doc, dict):
        raise SafetensorsHeaderError("header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsHeaderError("__metadata__ must map strings to strings")
    data_start = 8 + len(raw)
    tensors = {name: _tensor_info(name, entry) for name, entry in doc.items()}
    _check_tiling(tensors, total - data_start)
    return SafetensorsHeader(MappingProxyType(tensors), MappingProxyType(dict(metadata)), data_start, total)


def _is_uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _tensor_info(name: str, entry: object) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsHeaderError(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise SafetensorsHeaderError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise SafetensorsHeaderError(f"tensor {name!r}: shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise SafetensorsHeaderError(f"tensor {name!r}: data_offsets must be two non-negative integers")
    start, end = offsets
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end < start or end - start != expected:
        raise SafetensorsHeaderError(
            f"tensor {name!r}: data_offsets {offsets} hold {end - start} bytes, "
            f"but {dtype} {shape} needs {expected}")
    return TensorInfo(dtype, tuple(shape), start, end)


def _check_tiling(tensors: dict[str, TensorInfo], data_len: int) -> None:
    cursor = 0
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if info.start != cursor:
            what = "overlaps the previous tensor" if info.start < cursor else "leaves a gap before it"
            raise SafetensorsHeaderError(f"tensor {name!r}: data_offsets start at {info.start}, which {what}")
        cursor = info.end
    if cursor > data_len:
        raise SafetensorsHeaderError(
            f"truncated: tensors need {cursor} data bytes but the file holds {data_len}")
    if cursor < data_len:
        raise SafetensorsHeaderError(f"{data_len - cursor} trailing bytes after the last tensor")
