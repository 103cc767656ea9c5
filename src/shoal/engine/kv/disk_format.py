"""One prefix block as a file: magic, header length, JSON header, raw tensor bytes.

    b"SHOALKV1" | u32 little-endian header length | header (UTF-8 JSON) | payload

The header names the block (its hash, its parent's hash and its tokens, so a reader can check
the chain), each tensor's shape and dtype, the payload's length and its blake2b checksum. A
file cut short, or whose bytes changed, fails decoding (CorruptBlock) and is thrown away.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from shoal.engine.kv.prefix_cache import hash_block
from shoal.engine.kv.transfer import PrefixBlocks

MAGIC = b"SHOALKV1"
_LENGTH = struct.Struct("<I")
PREAMBLE_BYTES = len(MAGIC) + _LENGTH.size
_MAX_HEADER_BYTES = 1 << 20
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "int8": torch.int8, "uint8": torch.uint8}


class CorruptBlock(ValueError):
    """A block file that is cut short, altered, or not a block file at all."""


def encode_block(block: PrefixBlocks) -> bytes:
    """The file's bytes for a one-block PrefixBlocks."""
    if block.num_blocks != 1:
        raise ValueError("a block file holds exactly one block")
    payload = b"".join(_tensor_bytes(t) for t in block.tensors)
    header = json.dumps({
        "hash": block.block_hashes[0].hex(),
        "parent": block.parent_hash.hex(),
        "tokens": list(block.token_ids),
        "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")]
                    for t in block.tensors],
        "payload_bytes": len(payload),
        "checksum": _checksum(payload),
    }, separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + payload


def header_length(preamble: bytes) -> int:
    """The header's length from a file's first PREAMBLE_BYTES; CorruptBlock if not a block."""
    if len(preamble) < PREAMBLE_BYTES or preamble[:len(MAGIC)] != MAGIC:
        raise CorruptBlock("not a shoal KV block file")
    (length,) = _LENGTH.unpack_from(preamble, len(MAGIC))
    if not 0 < length <= _MAX_HEADER_BYTES:
        raise CorruptBlock(f"a header of {length} bytes")
    return length


def parse_header(raw: bytes) -> dict:
    """The header's fields, checked for the types decoding relies on."""
    try:
        header = json.loads(raw)
        tensors = [(tuple(int(n) for n in shape), _DTYPES[dtype])
                   for shape, dtype in header["tensors"]]
        checked = {"hash": bytes.fromhex(header["hash"]),
                   "parent": bytes.fromhex(header["parent"]),
                   "tokens": tuple(int(t) for t in header["tokens"]),
                   "tensors": tensors,
                   "payload_bytes": int(header["payload_bytes"]),
                   "checksum": str(header["checksum"])}
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptBlock(f"unreadable header: {error}") from None
    expected = sum(_numel(shape) * dtype.itemsize for shape, dtype in tensors)
    if checked["payload_bytes"] != expected:
        raise CorruptBlock("the header's payload length does not match its tensors")
    return checked


def file_length(preamble_and_header: bytes) -> int:
    """The whole file's length as its header states it (to spot a file cut short)."""
    length = header_length(preamble_and_header[:PREAMBLE_BYTES])
    header = parse_header(preamble_and_header[PREAMBLE_BYTES:PREAMBLE_BYTES + length])
    return PREAMBLE_BYTES + length + header["payload_bytes"]


def decode_block(data: bytearray, block_size: int) -> PrefixBlocks:
    """The block in a file's bytes; CorruptBlock unless the checksum and the hash chain hold.
    The tensors share data's memory."""
    length = header_length(bytes(data[:PREAMBLE_BYTES]))
    header = parse_header(bytes(data[PREAMBLE_BYTES:PREAMBLE_BYTES + length]))
    start = PREAMBLE_BYTES + length
    if len(data) != start + header["payload_bytes"]:
        raise CorruptBlock(f"{len(data)} bytes where the header promises "
                           f"{start + header['payload_bytes']}")
    payload = memoryview(data)[start:]
    if _checksum(payload) != header["checksum"]:
        raise CorruptBlock("the payload's checksum does not match")
    tokens = header["tokens"]
    if len(tokens) != block_size or hash_block(header["parent"], tokens) != header["hash"]:
        raise CorruptBlock("the block's hash does not follow from its parent and tokens")
    tensors, offset = [], 0
    for shape, dtype in header["tensors"]:
        size = _numel(shape) * dtype.itemsize
        raw = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=start + offset)
        tensors.append(raw.view(dtype).reshape(shape))
        offset += size
    return PrefixBlocks(header["parent"], tokens, (header["hash"],), tuple(tensors), block_size)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    # Raw bytes of any dtype (bfloat16 has no numpy twin): reinterpret as uint8 first.
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _checksum(payload) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        if n < 0:
            raise CorruptBlock(f"a negative dimension in {shape}")
        count *= n
    return count
