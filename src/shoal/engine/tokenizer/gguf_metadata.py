"""Read the key/value metadata section of a GGUF file, and nothing else.

gguf.GGUFReader also maps every tensor and turns each of a 262k-entry string array into numpy
views, which takes seconds; the tokenizer needs only the metadata, so this reads it directly.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from shoal.engine.errors import UnsupportedModel

_MAGIC = b"GGUF"
_STRING = 8
_ARRAY = 9
# GGUF value type -> struct format (little-endian scalars).
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY_DTYPES = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}


class GGUFFormatError(UnsupportedModel):
    """The file is not a GGUF file this reader understands."""


class _Truncated(Exception):
    """Parsing ran past the bytes read so far."""


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        if self.pos + struct.calcsize(fmt) > len(self.data):
            raise _Truncated
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.pos + length
        if end > len(self.data):
            raise _Truncated
        raw = self.data[self.pos:end]
        self.pos = end
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise GGUFFormatError(f"unknown GGUF value type {value_type}")
        return self.scalar(fmt)

    def array(self) -> Any:
        element_type = self.scalar("<I")
        count = self.scalar("<Q")
        if element_type == _STRING:
            return [self.string() for _ in range(count)]
        if element_type == _ARRAY:
            return [self.array() for _ in range(count)]
        dtype = _NUMPY_DTYPES.get(element_type)
        if dtype is None:
            raise GGUFFormatError(f"unknown GGUF array element type {element_type}")
        if self.pos + count * np.dtype(dtype).itemsize > len(self.data):
            raise _Truncated
        values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos)
        self.pos += values.nbytes
        return values.tolist()


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """All metadata key/values of a GGUF (version 2 or 3, little-endian) file.

    Reads the file only up to the end of the metadata section (a few MB for a 262k vocabulary).
    """
    with open(path, "rb") as handle:
        header = handle.read(24)
        if len(header) < 24 or header[:4] != _MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file")
        version, _tensor_count, kv_count = struct.unpack_from("<IQQ", header, 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: GGUF version {version} is not supported")
        # The metadata size is not stored: read a chunk, and read more while parsing runs
        # off its end. A 262k-token vocabulary fits in the first 16 MiB.
        data = handle.read(16 << 20)
        while True:
            try:
                return _parse(data, kv_count)
            except _Truncated:
                more = handle.read(max(len(data), 16 << 20))
                if not more:
                    raise GGUFFormatError(f"{path}: metadata section is truncated") from None
                data += more


def _parse(data: bytes, kv_count: int) -> dict[str, Any]:
    cursor = _Cursor(data)
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"))
    return metadata
