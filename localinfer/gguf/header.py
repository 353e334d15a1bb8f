"""Read a GGUF file's header: metadata and tensor descriptions, without the tensor data.

`gguf.GGUFReader` builds numpy views for every element of every array, which takes about ten
seconds on Gemma 3's 262k-token vocabulary here; `info` needs only the counts, so long arrays are
skipped and summarised by length. Type names and block sizes are a table here rather than imported
from the gguf package, whose import (numpy included) would cost `quantize` a tenth of a second;
tests/test_quantize.py checks the table against gguf's.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass, field
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
_SCALAR_BYTES = {vtype: struct.calcsize("<" + fmt) for vtype, fmt in _SCALARS.items()}
_STRING, _ARRAY = 8, 9
# Arrays up to this length are kept whole, longer ones become their length: per-layer values (at
# most LLAMA_MAX_LAYERS of them) stay readable, a vocabulary is skipped. Elements kept in all are
# bounded too, so a file of many short arrays cannot make the reader hold many Python objects.
_KEEP_ARRAY = 512
_KEEP_ELEMENTS = 1 << 16
# Text is decoded into Python strings of up to 4 bytes a character (and the decoder's "replace" path
# needs more while it works: 650 MB for a 107 MB string). A string value longer than _LONG_TEXT is
# left in the file as TextInfo (the longest real ones, chat templates, are tens of KB), and keys and
# string values together may decode to _KEEP_TEXT bytes of the file at most.
_LONG_TEXT = 1 << 20
_KEEP_TEXT = 8 << 20
_U64 = struct.Struct("<Q").unpack_from

# Limits, as llama.cpp's own GGUF reader (ggml/src/gguf.cpp) enforces them, or tighter where a
# count from the file would otherwise decide how much memory this reader takes.
VERSIONS = (2, 3)                 # llama.cpp refuses GGUFv1 (32-bit counts) and anything newer
MAX_DIMS = 4                      # GGML_MAX_DIMS
MAX_NAME = 64                     # GGML_MAX_NAME: a tensor name must be shorter
MAX_STRING = 1 << 30              # GGUF_MAX_STRING_LENGTH
MAX_KEY = (1 << 16) - 1           # the GGUF specification's limit on a key's length
# Each tensor and entry becomes a Python object here, and a ggml one in llama.cpp: a count beyond
# these is a corrupt file, not a model (512 layers, LLAMA_MAX_LAYERS, of at most 128 tensors each;
# real models have up to a few thousand tensors and a few dozen entries).
MAX_TENSORS = 1 << 16
MAX_ENTRIES = 1 << 16
_MIN_ENTRY_BYTES = 8 + 1 + 4 + 1          # key length, a key of one byte, value type, a u8 value
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8         # name length, n_dims, type, offset (a name may be empty)
_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
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
    metadata: dict[str, object]     # long arrays appear as ArrayInfo, long strings as TextInfo
    tensors: list[Tensor]
    header_size: int = 0            # bytes of metadata and tensor infos, before alignment padding
    # File offset of each array's first element, for checks that read one (the vocabulary).
    array_offsets: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ArrayInfo:
    length: int
    element_type: int = _STRING     # GGUF value type of the elements


@dataclass(frozen=True)
class TextInfo:
    length: int                     # bytes of UTF-8 in the file, not decoded


class CorruptFile(Exception):
    """What is wrong with a file, in words for the user; the caller names the file."""


def printable(text: str, limit: int = 60) -> str:
    """A name from a file, fit for a one-line message: control characters escaped, cut short."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0
        self.kept = 0             # array elements kept so far (see _KEEP_ELEMENTS)
        self.text = 0             # bytes of keys and string values decoded so far (_KEEP_TEXT)

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self, limit: int = MAX_STRING, *, counted: bool = True) -> str:
        """A string decoded (counted against _KEEP_TEXT unless a tensor name, <64 bytes)."""
        n = self._length(limit)
        if counted:
            self.text += n
            if self.text > _KEEP_TEXT:
                raise CorruptFile(f"more than {_KEEP_TEXT >> 20} MiB of metadata text")
        # Decoded straight from the file's pages, without a copy of the bytes first.
        text = str(memoryview(self.buf)[self.pos:self.pos + n], "utf-8", "replace")
        self.pos += n
        return text

    def text_value(self) -> str | TextInfo:
        start = self.pos
        n = self._length(MAX_STRING)
        if n <= _LONG_TEXT:
            self.pos = start
            return self.string()
        self.pos += n
        return TextInfo(n)

    def _length(self, limit: int) -> int:
        n = self.unpack("Q")
        if n > self.remaining():
            raise CorruptFile(f"a string of {n} bytes runs past the end of the file")
        if n > limit:
            raise CorruptFile(f"a string of {n} bytes, longer than the {limit} allowed")
        return n

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.text_value()
        if vtype == _ARRAY:
            return self.array(self.unpack("I"), self.unpack("Q"))
        if vtype not in _SCALARS:
            raise CorruptFile(f"unknown value type {vtype}")
        return self.unpack(_SCALARS[vtype])

    def array(self, etype: int, n: int):
        """The elements after an array's type and length: a list, or ArrayInfo when long."""
        if etype == _ARRAY:       # llama.cpp refuses them; refused here before any recursion
            raise CorruptFile("an array of arrays")
        smallest = 8 if etype == _STRING else _SCALAR_BYTES.get(etype)
        if smallest is None:
            raise CorruptFile(f"an array of unknown value type {etype}")
        if n * smallest > self.remaining():
            raise CorruptFile(f"an array of {n} elements runs past the end of the file")
        if n <= _KEEP_ARRAY and self.kept + n <= _KEEP_ELEMENTS:
            self.kept += n
            return [self.value(etype) for _ in range(n)]
        if etype == _STRING:
            self.pos = self._skip_strings(n)
        else:
            self.pos += n * smallest
        return ArrayInfo(n, etype)

    def _skip_strings(self, n: int) -> int:
        # Variable length: walk the lengths only (a vocabulary has 50k-260k of them; locals keep
        # the loop tight). A length past the end makes the next read fail (struct.error).
        buf, pos = self.buf, self.pos
        for _ in range(n):
            pos += 8 + _U64(buf, pos)[0]
        if pos > len(buf):
            raise CorruptFile("a string array runs past the end of the file")
        return pos


def read_header(path: Path) -> Header:
    """The metadata and tensor descriptions of a GGUF file, every count and size checked against
    the file; a ModelLoadError (one line) for any file that is not a well-formed GGUF.

    Parsed once per process while the file is unchanged (same inode, size and times): one `run`
    reads the header for the memory estimate, the backend choice and the load, and Gemma 3's takes
    80 ms. The Header is shared between callers; none may modify it.
    """
    try:
        return _read_file(Path(path), file_identity(path))
    except (ValueError, OSError) as e:   # mmap of an empty file raises ValueError
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def file_identity(path: Path) -> tuple[int, ...]:
    """What changes when the file is replaced or rewritten: the key of per-file memos."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@functools.lru_cache(maxsize=8)
def _read_file(path: Path, _identity: tuple[int, ...]) -> Header:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse(buf, path)


def _parse(buf, path: Path) -> Header:
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF model file")
    cur = _Cursor(buf)
    cur.pos = 4
    try:
        return _read(cur, len(buf))
    except CorruptFile as e:
        raise ModelLoadError(f"{path} is not a valid GGUF file: {e}") from None
    except (struct.error, OverflowError):   # a read past the end, or at an offset beyond any file
        raise ModelLoadError(f"{path} is truncated or corrupt (bad GGUF header)") from None


def parse_start(buf: bytes, file_size: int, name: str) -> Header | None:
    """The header of a file of `file_size` bytes from its first bytes `buf` (a remote file's start,
    read with a range request); None when `buf` may end before the header does. The same checks
    as `read_header`, the tensor data's extent against `file_size`."""
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{name} is not a GGUF model file")
    cur = _Cursor(buf)
    cur.pos = 4
    try:
        return _read(cur, file_size)
    except CorruptFile as e:
        if len(buf) < file_size:      # perhaps only cut short here
            return None
        raise ModelLoadError(f"{name} is not a valid GGUF file: {e}") from None
    except (struct.error, OverflowError):
        if len(buf) < file_size:
            return None
        raise ModelLoadError(f"{name} is truncated or corrupt (bad GGUF header)") from None


def _read(cur: _Cursor, file_size: int) -> Header:
    version = cur.unpack("I")
    if version not in VERSIONS:
        raise CorruptFile(f"GGUF version {version} (versions 2 and 3 are supported)")
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    _check_count("tensors", n_tensors, MAX_TENSORS, cur.remaining() // _MIN_TENSOR_BYTES)
    _check_count("metadata entries", n_kv, MAX_ENTRIES, cur.remaining() // _MIN_ENTRY_BYTES)
    metadata, array_offsets = _metadata(cur, n_kv)
    alignment = _alignment(metadata)
    tensors = _tensors(cur, n_tensors)
    data_start = _pad(cur.pos, alignment)
    data_end = data_start + _check_layout(tensors, alignment)
    if data_end > file_size:
        raise CorruptFile(f"it is truncated: {file_size} bytes, the header describes {data_end}")
    return Header(version, metadata, tensors, cur.pos, array_offsets)


def _check_count(what: str, n: int, limit: int, fits: int) -> None:
    if n > fits:
        raise CorruptFile(f"it declares {n} {what}, more than its size can hold ({fits})")
    if n > limit:
        raise CorruptFile(f"it declares {n} {what}, more than any model has (at most {limit})")


def _metadata(cur: _Cursor, n_kv: int) -> tuple[dict[str, object], dict[str, int]]:
    metadata: dict[str, object] = {}
    array_offsets: dict[str, int] = {}
    for _ in range(n_kv):
        try:
            key = cur.string(MAX_KEY)
        except CorruptFile as e:
            raise CorruptFile(f"a metadata key: {e}") from None
        if not key:
            raise CorruptFile("a metadata key is empty")
        if key in metadata:
            raise CorruptFile(f"metadata key {printable(key)} appears twice")
        vtype = cur.unpack("I")
        try:
            if vtype == _ARRAY:
                etype, n = cur.unpack("I"), cur.unpack("Q")
                array_offsets[key] = cur.pos
                metadata[key] = cur.array(etype, n)
            else:
                metadata[key] = cur.value(vtype)
        except CorruptFile as e:
            raise CorruptFile(f"metadata key {printable(key)}: {e}") from None
    return metadata, array_offsets


def _alignment(metadata: dict[str, object]) -> int:
    # llama.cpp: a u32, a power of two; anything else and it refuses the file.
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise CorruptFile(f"general.alignment = {alignment!r} is not a power of two")
    return alignment


def _tensors(cur: _Cursor, n_tensors: int) -> list[Tensor]:
    tensors, names = [], set()
    for _ in range(n_tensors):
        tensor = _tensor(cur)
        if tensor.name in names:
            raise CorruptFile(f"tensor {printable(tensor.name)} appears twice")
        names.add(tensor.name)
        tensors.append(tensor)
    return tensors


def _tensor(cur: _Cursor) -> Tensor:
    try:
        name = cur.string(MAX_NAME - 1, counted=False)
    except CorruptFile as e:
        raise CorruptFile(f"a tensor name: {e}") from None
    n_dims = cur.unpack("I")
    if n_dims > MAX_DIMS:
        raise CorruptFile(f"tensor {printable(name)} has {n_dims} dimensions (at most {MAX_DIMS})")
    shape = tuple(cur.unpack("Q") for _ in range(n_dims))
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    if n_elements > _INT64_MAX or any(dim > _INT64_MAX for dim in shape):
        raise CorruptFile(f"tensor {printable(name)} has shape {shape}, too large for any machine")
    type_id, offset = cur.unpack("I"), cur.unpack("Q")
    if type_id not in GGML_TYPES:
        raise CorruptFile(f"tensor {printable(name)} has a type this version does not know "
                          f"(ggml type {type_id})")
    type_name, block, block_bytes = GGML_TYPES[type_id]
    if shape and shape[0] % block:
        raise CorruptFile(f"tensor {printable(name)} has rows of {shape[0]} {type_name} values, "
                          f"not a multiple of its block of {block}")
    return Tensor(name, type_name, n_elements, n_elements // block * block_bytes, offset, shape)


def check_tensors(header: Header) -> None:
    """Refuse a tensor with a zero dimension: llama-model-loader.cpp's create_tensor asserts
    ne[dim] >= 1, and the GGUF reader lets one through. Here, below checks and split, because
    both check tensors: those of a whole file and those of every part of a split model."""
    for t in header.tensors:
        if 0 in t.shape:
            raise CorruptFile(f"tensor {printable(t.name)} has shape {t.shape}, with a zero "
                              "dimension")


def _check_layout(tensors: list[Tensor], alignment: int) -> int:
    """Bytes of the data section. As llama.cpp requires, each tensor starts where the one before
    ends, padded to the alignment: no overlap, no gap, nothing outside the file."""
    size = 0
    for t in tensors:
        if t.offset != size:
            raise CorruptFile(f"tensor {printable(t.name)} starts at data offset {t.offset}, "
                              f"expected {size}")
        size += _pad(t.n_bytes, alignment)
    return size


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment
