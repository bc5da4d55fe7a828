"""A safetensors checkpoint read one tensor at a time, with plain reads instead of a memory map.

Why not safetensors' own `safe_open` on a CPU engine: every tensor it returns is a view of one map
of the whole file, and a single view kept alive (the embedding, a norm) keeps every page read
through the map resident. A quantized engine reads each float projection once to quantize it, so
the map kept the whole float checkpoint in the process's RSS next to its int8 copy (issue 42: int8
served in more memory than float32). Here a tensor is read into memory of its own when it is taken
(`CheckpointTensors.pop`), converted, and freed once the model has quantized or fused it: loading
peaks at one layer's float tensors, and no float copy of a quantized weight outlives its layer.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

# safetensors' dtype names (its format specification)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_index(path: Path) -> dict[str, TensorEntry]:
    """The file's tensors by key, from its header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    return {key: TensorEntry(path, DTYPES[meta["dtype"]], tuple(meta["shape"]), base + meta["data_offsets"][0],
                             base + meta["data_offsets"][1])
            for key, meta in header.items() if key != "__metadata__"}


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """The tensor in CPU memory of its own (no map of the file stays behind)."""
    raw = torch.empty(entry.end - entry.start, dtype=torch.uint8)
    with open(entry.path, "rb") as f:
        f.seek(entry.start)
        got = f.readinto(memoryview(raw.numpy()))
    if got != raw.numel():
        raise OSError(f"{entry.path} ends inside a tensor ({got} of {raw.numel()} bytes)")
    return raw.view(entry.dtype).reshape(entry.shape)


class CheckpointTensors(MutableMapping):
    """Checkpoint key -> tensor, each read from disk and converted when first asked for.

    `pop` (what the model's construction does with every projection) reads without keeping: the
    float tensor lives only as long as its taker holds it. `[key]` keeps what it read (a tensor
    the model holds anyway: the embedding, a norm). Tensors set here (a GPTQ checkpoint's
    dequantized ones) are held as given.
    """

    def __init__(self, entries: dict[str, TensorEntry], convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._entries = dict(entries)
        self._convert = convert
        self._held: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str):
        if key not in self._held:
            self._held[key] = self._convert(read_tensor(self._entries.pop(key)))
        return self._held[key]

    def pop(self, key: str, *default):
        if key in self._held:
            return self._held.pop(key)
        if key in self._entries:
            return self._convert(read_tensor(self._entries.pop(key)))
        if default:
            return default[0]
        raise KeyError(key)

    def __setitem__(self, key: str, value) -> None:
        self._entries.pop(key, None)
        self._held[key] = value

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self._entries.pop(key, None)
        self._held.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._held or key in self._entries

    def __iter__(self) -> Iterator[str]:
        yield from list(self._held)
        yield from list(self._entries)

    def __len__(self) -> int:
        return len(self._held) + len(self._entries)
