"""Read a GGUF file's header: metadata and tensor descriptions, without the tensor data.

`gguf.GGUFReader` builds numpy views for every element of every array, which takes about ten
seconds on Gemma 3's 262k-token vocabulary here; `info` needs only the counts, so long arrays are
skipped and summarised by length. Type names and block sizes are a table here rather than imported
from the gguf package, whose import (numpy included) would cost `quantize` a tenth of a second;
tests/test_quantize.py checks the table against gguf's.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from localinfer.errors import ModelLoadError

# ggml_type id: (name, elements per block, bytes per block), as gguf.GGML_QUANT_SIZES.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4),
    27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
BLOCK_SIZES: dict[str, tuple[int, int]] = {name: (block, size)
                                           for name, block, size in GGML_TYPES.values()}

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY = 64          # arrays up to this length are kept whole; longer ones become their length
_U64 = struct.Struct("<Q").unpack_from


@dataclass(frozen=True)
class Tensor:
    name: str
    type_name: str
    n_elements: int
    n_bytes: int
    offset: int                     # from the start of the data section
    shape: tuple[int, ...] = ()     # ne0 (row length) first, as ggml orders dimensions


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, object]     # long arrays appear as ArrayInfo
    tensors: list[Tensor]
    header_size: int = 0            # bytes of metadata and tensor infos, before alignment padding


@dataclass(frozen=True)
class ArrayInfo:
    length: int


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.unpack("Q")
        raw = self.buf[self.pos:self.pos + n]
        if len(raw) != n:
            raise struct.error("string runs past the end of the file")
        self.pos += n
        return bytes(raw).decode("utf-8", "replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        return self.unpack(_SCALARS[vtype])

    def array(self):
        etype, n = self.unpack("I"), self.unpack("Q")
        if n <= _KEEP_ARRAY:
            return [self.value(etype) for _ in range(n)]
        if etype == _STRING:
            # Variable length: walk the lengths only (a vocabulary has 50k-260k of them; locals
            # keep the loop tight).
            buf, pos = self.buf, self.pos
            for _ in range(n):
                pos += 8 + _U64(buf, pos)[0]
            self.pos = pos
        else:
            self.pos += n * struct.calcsize(_SCALARS[etype])
        return ArrayInfo(n)


def read_header(path: Path) -> Header:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path)
    except (ValueError, OSError) as e:   # mmap of an empty file raises ValueError
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _parse(buf, path: Path) -> Header:
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF model file")
    cur = _Cursor(buf)
    cur.pos = 4
    try:
        version, n_tensors, n_kv = cur.unpack("I"), cur.unpack("Q"), cur.unpack("Q")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("I"))
        tensors = [_tensor(cur) for _ in range(n_tensors)]
    except (struct.error, KeyError) as e:
        raise ModelLoadError(f"{path} is truncated or corrupt (bad GGUF header)") from e
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    data_end = max((t.offset + t.n_bytes for t in tensors), default=0)
    if data_start + data_end > len(buf):
        raise ModelLoadError(f"{path} is truncated: {len(buf)} bytes, "
                             f"the header describes {data_start + data_end}")
    return Header(version, metadata, tensors, cur.pos)


def _tensor(cur: _Cursor) -> Tensor:
    name = cur.string()
    n_dims = cur.unpack("I")
    shape = tuple(cur.unpack("Q") for _ in range(n_dims))
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    type_id = cur.unpack("I")
    offset = cur.unpack("Q")
    if type_id not in GGML_TYPES:
        raise ModelLoadError(f"tensor {name} has a type this version does not know "
                             f"(ggml type {type_id})")
    type_name, block, block_bytes = GGML_TYPES[type_id]
    return Tensor(name, type_name, n_elements, n_elements // block * block_bytes, offset, shape)
