"""shoal's one GGUF reader: header metadata and tensor locations, memory-mapped.

Why not gguf.GGUFReader: it turns every entry of every array (a 150k-262k token vocabulary
and its merges) into numpy views at open, 1.7 s for SmolLM2-135M and 7.4-7.6 s for Gemma 3
270M and Qwen2.5-Coder-0.5B on this project's reference host, against 15-21 ms here. This
reader walks the header with struct, skips arrays at open (recording where they lie) and
decodes them only when asked (`array`, `read_gguf_metadata`: the tokenizer's vocabulary).
The type codes and the scalar and quantization type tables are the gguf package's own.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from shoal.engine.errors import UnsupportedModel

# GGUF value type -> numpy scalar type (little-endian in the file).
_SCALAR_DTYPES = {kind: np.dtype(scalar).newbyteorder("<")
                  for kind, scalar in GGUFReader.gguf_scalar_to_np.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
DEFAULT_ALIGNMENT = 32


class GGUFFormatError(UnsupportedModel):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]   # GGUF order: innermost first
    type_name: str          # GGMLQuantizationType name, e.g. "Q4_1"
    offset: int             # from the start of the file

    @property
    def nbytes(self) -> int:
        """The tensor's bytes in the file."""
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.type_name]]
        rows = int(np.prod(self.dims[1:], dtype=np.int64)) if len(self.dims) > 1 else 1
        return rows * (self.dims[0] // block * block_bytes)


class GGUFFile:
    """metadata: key -> scalar or string; an array's value is None there (read it with
    `array(key)`). tensors: name -> TensorInfo, in file order."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            try:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFFormatError(f"{self.path} is not a GGUF file") from None
        if self._map[:4] != b"GGUF" or len(self._map) < 24:
            raise GGUFFormatError(f"{self.path} is not a GGUF file")
        self._pos = 4
        version, tensor_count, kv_count = self._u32(), self._u64(), self._u64()
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported")
        self.metadata: dict[str, Any] = {}
        self._arrays: dict[str, int] = {}  # key -> where its array (element type) starts
        try:
            self._read_metadata(kv_count)
            infos = [self._tensor_info() for _ in range(tensor_count)]
        except (struct.error, IndexError, ValueError) as error:
            raise GGUFFormatError(f"{self.path}: header is truncated or corrupt") from error
        alignment = int(self.metadata.get("general.alignment") or DEFAULT_ALIGNMENT)
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = {name: TensorInfo(name, dims, GGMLQuantizationType(kind).name,
                                         data_start + offset)
                        for name, dims, kind, offset in infos}
        self._array: np.memmap | None = None  # the tensor bytes, mapped on first data()

    # -- metadata -----------------------------------------------------------------------

    def array(self, key: str) -> list[Any] | None:
        """The decoded array stored under key (None if the key is absent or not an array)."""
        start = self._arrays.get(key)
        if start is None:
            return None
        self._pos = start
        return self._decode_array()

    def all_metadata(self) -> dict[str, Any]:
        """Every key with its value, arrays decoded (a vocabulary costs 50-150 ms)."""
        return {key: self.array(key) if key in self._arrays else value
                for key, value in self.metadata.items()}

    def _read_metadata(self, kv_count: int) -> None:
        for _ in range(kv_count):
            key = self._string()
            kind = self._u32()
            if kind == GGUFValueType.ARRAY:
                self._arrays[key] = self._pos
                self._skip_array()
                self.metadata[key] = None
            else:
                self.metadata[key] = self._value(kind)

    def _u32(self) -> int:
        value = _U32.unpack_from(self._map, self._pos)[0]
        self._pos += 4
        return value

    def _u64(self) -> int:
        value = _U64.unpack_from(self._map, self._pos)[0]
        self._pos += 8
        return value

    def _string(self) -> str:
        length = self._u64()
        if self._pos + length > len(self._map):
            raise ValueError("string runs past the end of the file")
        raw = self._map[self._pos:self._pos + length]
        self._pos += length
        return raw.decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            return self._decode_array()
        dtype = self._scalar_dtype(kind)
        value = np.frombuffer(self._map, dtype=dtype, count=1, offset=self._pos)[0].item()
        self._pos += dtype.itemsize
        return value

    def _decode_array(self) -> list[Any]:
        kind, count = self._u32(), self._u64()
        if kind == GGUFValueType.STRING:
            return [self._string() for _ in range(count)]
        if kind == GGUFValueType.ARRAY:
            return [self._decode_array() for _ in range(count)]
        dtype = self._scalar_dtype(kind)
        values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
        self._pos += values.nbytes
        return values.tolist()

    def _skip_array(self) -> None:
        kind, count = self._u32(), self._u64()
        if kind == GGUFValueType.STRING:  # a vocabulary: 150k-260k strings, skipped undecoded
            length, data, pos = _U64.unpack_from, self._map, self._pos
            for _ in range(count):
                pos += 8 + length(data, pos)[0]
            self._pos = pos
        elif kind == GGUFValueType.ARRAY:
            for _ in range(count):
                self._skip_array()
        else:
            self._pos += count * self._scalar_dtype(kind).itemsize
        if self._pos > len(self._map):
            raise ValueError("array runs past the end of the file")

    def _scalar_dtype(self, kind: int) -> np.dtype:
        try:
            return _SCALAR_DTYPES[GGUFValueType(kind)]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"{self.path}: unknown GGUF value type {kind}") from None

    # -- tensors ------------------------------------------------------------------------

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._u64() for _ in range(self._u32()))
        kind = self._u32()
        return name, dims, kind, self._u64()

    def data(self, info: TensorInfo) -> np.ndarray:
        """Read-only uint8 [rows, bytes per row] (or float array for F32/F16) of one tensor."""
        if self._array is None:
            self._array = np.memmap(self.path, dtype=np.uint8, mode="r")
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[info.type_name]]
        inner = info.dims[0]
        rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
        row_bytes = inner // block * block_bytes
        raw = self._array[info.offset:info.offset + rows * row_bytes].reshape(rows, row_bytes)
        if info.type_name in ("F32", "F16"):
            dtype = np.float32 if info.type_name == "F32" else np.float16
            raw = raw.view(dtype)
            return raw.reshape(-1) if len(info.dims) == 1 else raw
        return raw


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """All metadata key/values of a GGUF (version 2 or 3) file, arrays decoded."""
    return GGUFFile(path).all_metadata()
