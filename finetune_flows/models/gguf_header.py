"""A GGUF file's header, read in milliseconds without the `gguf` package (whose reader maps every tensor: about two
seconds for the built-in 135M model): its architecture, and how long the file must be to hold the tensor data the
header declares, so a truncated or corrupt file is named before a run instead of failing inside transformers.

Layout (little-endian; a big-endian file has its version byte-swapped): magic `GGUF`, u32 version (2 or 3), u64
tensor count, u64 key/value count, the key/value metadata, the tensor infos (name, dims, ggml type, offset), then
the tensor data from the header's end rounded up to `general.alignment` (default 32)."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

# (elements per block, bytes per block) of the ggml tensor types, as gguf's GGML_QUANT_SIZES gives them; a tensor of
# a type not listed here (a newer one) has only its offset checked
GGML_BLOCKS = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),  # F32..Q8_1
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),  # Q2_K..Q8_K
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 29: (256, 56),  # the IQ types
    24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2),  # I8, I16, I32, I64, F64, BF16
}
# bytes of each fixed-size metadata value type (8: string and 9: array are read apart)
VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4


class GGUFError(ValueError):
    """The file is not a GGUF transformers can read: the message says why, to follow the file's name."""


class GGUFHeader(NamedTuple):
    architecture: str | None  # general.architecture
    needed_bytes: int  # the header plus the end of the last tensor's data
    size: int  # the file's length


def read_gguf_header(path: Path) -> GGUFHeader:
    """The header of the GGUF at `path`; a GGUFError where it cannot be read (ends inside the header, unknown
    version). The tensor data is not read; only the header's pages are."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFError(f"is truncated or corrupt: {size} bytes, less than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(buf, size)
            except struct.error:  # a read past the end: the file stops inside its header
                raise GGUFError(f"is truncated or corrupt: it ends inside its header (the file has {size} "
                                "bytes)") from None


def _parse(buf, size: int) -> GGUFHeader:
    if buf[:4] != b"GGUF":
        raise GGUFError("is not a GGUF file (no GGUF magic)")
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # a byte-swapped version: big-endian
    u32, u64 = struct.Struct(order + "I").unpack_from, struct.Struct(order + "Q").unpack_from
    version = u32(buf, 4)[0]
    if version not in (2, 3):
        raise GGUFError(f"is GGUF version {version}; transformers reads versions 2 and 3")
    tensors, kvs = u64(buf, 8)[0], u64(buf, 16)[0]
    pos, architecture, alignment = 24, None, 32

    def string(at: int) -> tuple[bytes, int]:
        length = u64(buf, at)[0]
        end = at + 8 + length
        if end > size:
            raise struct.error("past the end")
        return buf[at + 8:end], end

    def skip(kind: int, at: int) -> int:  # the position after a value of type `kind` at `at`
        if kind in VALUE_SIZES:
            return at + VALUE_SIZES[kind]
        if kind == STRING:
            return at + 8 + u64(buf, at)[0]
        if kind != ARRAY:
            raise GGUFError(f"is corrupt: metadata value type {kind} at byte {at} is not a GGUF type")
        item, count = u32(buf, at)[0], u64(buf, at + 4)[0]
        at += 12
        if item in VALUE_SIZES:
            return at + count * VALUE_SIZES[item]
        for _ in range(count):  # strings (a vocabulary: tens of thousands) or nested arrays, one by one
            at = skip(item, at)
            if at > size:
                break
        return at

    for _ in range(kvs):
        key, pos = string(pos)
        kind = u32(buf, pos)[0]
        pos += 4
        if key == b"general.architecture" and kind == STRING:
            value, _ = string(pos)
            architecture = value.decode("utf-8", "replace")
        elif key == b"general.alignment" and kind == UINT32:
            alignment = u32(buf, pos)[0]
        pos = skip(kind, pos)
        if pos > size:
            raise struct.error("past the end")
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"is corrupt: general.alignment={alignment} is not a power of two")
    end = 0  # of the tensor data, from its start
    for _ in range(tensors):
        _, pos = string(pos)
        dims = u32(buf, pos)[0]
        shape = struct.unpack_from(f"{order}{dims}Q", buf, pos + 4)
        pos += 4 + 8 * dims
        kind, offset = u32(buf, pos)[0], u64(buf, pos + 4)[0]
        pos += 12
        elements = 1
        for d in shape:
            elements *= d
        block, nbytes = GGML_BLOCKS.get(kind, (1, 0))  # an unknown type: its offset only
        end = max(end, offset + elements // block * nbytes)
    start = -(-pos // alignment) * alignment
    return GGUFHeader(architecture, start + end if tensors else pos, size)
