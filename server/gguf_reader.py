"""Reading a GGUF file: its metadata and its tensors, dequantised to float32.

The `gguf` package's GGUFReader builds a numpy view per array element while it parses the metadata:
on SmolLM2's 49152 tokens and 48900 merges that is 12 s of a 2-core machine's time per read (and
transformers' GGUF loader reads the file three times). Here the metadata is parsed with `struct`
in one pass over an mmap (well under a second); the `gguf` package still does the dequantisation,
which is vectorised numpy.

Format (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, key/value count
u64; the key/values; per tensor its name, dims (innermost first), type and offset; then the data,
aligned to `general.alignment` (32 by default).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of a scalar; 8 (string) and 9 (array) are read apart.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands; the message says what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): GGUF's dims reversed
    qtype: int              # gguf.GGMLQuantizationType value
    offset: int             # from the start of the data section


def is_gguf(path: str | os.PathLike) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == MAGIC


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"a string of {n} bytes runs past the end of the file")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _NUMPY:  # numeric arrays in one read
                dtype = np.dtype(_NUMPY[item])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFError(f"an array of {count} items runs past the end of the file")
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return values
            return [self.value(item) for _ in range(count)]
        raise GGUFError(f"unknown GGUF value type {kind}")


class GGUFFile:
    """An open GGUF file (memory-mapped): `metadata` (key -> value), `tensors` (name -> TensorInfo)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError) as e:
            self.close()
            raise GGUFError(f"{self.path}: truncated or malformed GGUF ({e})") from None
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        c = _Cursor(self._map)
        if bytes(self._map[:4]) != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (no GGUF magic)")
        c.pos = 4
        version = c.scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            self.metadata[key] = c.value(c.scalar("<I"))
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = c.string()
            dims = tuple(c.scalar("<Q") for _ in range(c.scalar("<I")))
            qtype, offset = c.scalar("<I"), c.scalar("<Q")
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), qtype, offset)
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self._data_start = -(-c.pos // align) * align

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantised to float32, in numpy order (e.g. [out, in] for a projection)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        try:
            qtype = GGMLQuantizationType(info.qtype)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {name} has unknown type {info.qtype}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if info.shape[-1] % block:
            raise GGUFError(f"{self.path}: tensor {name} rows of {info.shape[-1]} are not whole {qtype.name} blocks")
        row_bytes = info.shape[-1] // block * type_size
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        start = self._data_start + info.offset
        if start + rows * row_bytes > len(self._map):
            raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
        raw = np.frombuffer(self._map, dtype=np.uint8, count=rows * row_bytes, offset=start)
        out = dequantize(raw.reshape(*info.shape[:-1], row_bytes), qtype)  # out: info.shape, float32
        return np.array(out, dtype=np.float32, copy=True).reshape(info.shape)  # off the mmap

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
