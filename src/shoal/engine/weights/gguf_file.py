"""A minimal GGUF container reader: metadata scalars and tensor locations, memory-mapped.

gguf.GGUFReader turns every entry of a 262k-token vocabulary into numpy views (seconds per
load); the forward path needs only scalar metadata and where each tensor lies, so this walks
the header with struct and skips arrays. Tensor bytes come from one numpy memmap.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shoal.engine.errors import UnsupportedModel

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]   # GGUF order: innermost first
    type_name: str          # GGMLQuantizationType name, e.g. "Q4_1"
    offset: int             # from the start of the file


class GGUFFile:
    """metadata: key -> scalar or string (arrays are skipped, recorded as None)."""

    def __init__(self, path: Path) -> None:
        import gguf  # only for the quantization type table

        self.path = Path(path)
        with open(self.path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._map[:4] != b"GGUF":
            raise UnsupportedModel(f"{self.path} is not a GGUF file")
        self._pos = 4
        version, tensor_count, kv_count = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version < 2:
            raise UnsupportedModel(f"GGUF version {version} is too old")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment") or DEFAULT_ALIGNMENT)
        data_start = -(-self._pos // alignment) * alignment
        self._types = gguf.GGMLQuantizationType
        self._sizes = gguf.GGML_QUANT_SIZES
        self.tensors = {name: TensorInfo(name, dims, self._types(kind).name, data_start + off)
                        for name, dims, kind, off in infos}
        self._array = np.memmap(self.path, dtype=np.uint8, mode="r")

    def _read(self, fmt: str):
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._read("<Q")
        raw = self._map[self._pos:self._pos + length]
        self._pos += length
        return raw.decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise UnsupportedModel(f"unknown GGUF value type {kind}")
        item_kind, count = self._read("<I"), self._read("<Q")
        if item_kind in _SCALARS:
            self._pos += count * struct.calcsize(_SCALARS[item_kind])
        elif item_kind == _STRING:  # a vocabulary: 150k-260k strings, skipped undecoded
            length, data, pos = _U64.unpack_from, self._map, self._pos
            for _ in range(count):
                pos += 8 + length(data, pos)[0]
            self._pos = pos
        else:
            for _ in range(count):
                self._value(item_kind)
        return None

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._read("<Q") for _ in range(self._read("<I")))
        return name, dims, self._read("<I"), self._read("<Q")

    def data(self, info: TensorInfo) -> np.ndarray:
        """Read-only uint8 [rows, bytes per row] (or float array for F32/F16) of one tensor."""
        block, block_bytes = self._sizes[self._types[info.type_name]]
        inner = info.dims[0]
        rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
        row_bytes = inner // block * block_bytes
        raw = self._array[info.offset:info.offset + rows * row_bytes].reshape(rows, row_bytes)
        if info.type_name in ("F32", "F16"):
            dtype = np.float32 if info.type_name == "F32" else np.float16
            raw = raw.view(dtype)
            return raw.reshape(-1) if len(info.dims) == 1 else raw
        return raw
