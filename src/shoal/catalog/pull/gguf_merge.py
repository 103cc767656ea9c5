"""Join a GGUF model split into -0000N-of-0000M files (llama.cpp's gguf-split) into one
GGUF file, so the engine reads it as any other: the first part's metadata without the
split.* keys, then every part's tensors in order. Tensor data is copied from memory maps,
never held whole in memory."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import gguf

_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


class SplitError(ValueError):
    """The parts are not one split model (count or order wrong, tensors missing)."""


def merge_split_gguf(parts: Sequence[Path], target: Path) -> None:
    """Write parts, joined, to target (through a temporary name; nothing left on failure)."""
    readers = [gguf.GGUFReader(part) for part in parts]
    _check_split(readers, parts)
    first = readers[0]
    architecture = first.get_field(gguf.Keys.General.ARCHITECTURE)
    if architecture is None:
        raise SplitError(f"{parts[0].name} has no general.architecture")
    temporary = target.with_name(f".{target.name}.merging")
    try:
        writer = gguf.GGUFWriter(temporary, architecture.contents(), endianess=first.endianess)
        alignment = first.get_field(gguf.Keys.General.ALIGNMENT)
        if alignment is not None:  # data must be aligned as the metadata says
            writer.data_alignment = int(alignment.contents())
        for field in first.fields.values():
            if (field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.")
                    or field.name in _SPLIT_KEYS):
                continue
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
        for reader in readers:
            for tensor in reader.tensors:
                writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                                       tensor.data.nbytes, tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for reader in readers:
            for tensor in reader.tensors:
                writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
        writer.close()
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def _check_split(readers: list[gguf.GGUFReader], parts: Sequence[Path]) -> None:
    expected_tensors = None
    for index, (reader, part) in enumerate(zip(readers, parts, strict=True)):
        number, count = reader.get_field("split.no"), reader.get_field("split.count")
        if number is None or count is None:
            raise SplitError(f"{part.name} carries no split.no / split.count")
        if int(number.contents()) != index or int(count.contents()) != len(parts):
            raise SplitError(f"{part.name} says it is part {int(number.contents()) + 1} of "
                             f"{int(count.contents())}, not {index + 1} of {len(parts)}")
        total = reader.get_field("split.tensors.count")
        if index == 0 and total is not None:
            expected_tensors = int(total.contents())
    found = sum(len(reader.tensors) for reader in readers)
    if expected_tensors is not None and found != expected_tensors:
        raise SplitError(f"the {len(parts)} parts hold {found} tensors, not the "
                         f"{expected_tensors} the first part announces")
