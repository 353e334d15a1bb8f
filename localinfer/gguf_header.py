"""Read a GGUF file's header: metadata and tensor descriptions, without the tensor data.

`gguf.GGUFReader` builds numpy views for every element of every array, which takes about ten
seconds on Gemma 3's 262k-token vocabulary here; `info` needs only the counts, so long arrays are
skipped and summarised by length. Type names and block sizes still come from the gguf package.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localinfer.errors import ModelLoadError

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY = 64          # arrays up to this length are kept whole; longer ones become their length


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
            for _ in range(n):          # variable length: walk the lengths only
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
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
    qtype = GGMLQuantizationType(type_id)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return Tensor(name, qtype.name, n_elements, n_elements // block * block_bytes, offset, shape)
