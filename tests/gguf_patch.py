"""Make malformed copies of a real GGUF file: one metadata value or one vocabulary token rewritten.

The byte span of a value is found with the header reader's own cursor; after a splice that changes
the header's length the data section is moved to the next aligned offset, as a GGUF writer would,
so the only fault in the copy is the one a test puts there.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from localinfer.gguf.header import _Cursor, read_header

# GGUF value types this helper writes: unsigned/signed 32/64-bit integers, float32, bool, string.
_FORMATS = {4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q"}
_STRING = 8


def value_span(path: Path, key: str) -> tuple[int, int, int]:
    """(start, end, GGUF type) of the value of `key` in the file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        cur.pos = 4 + 4 + 8
        n_kv = cur.unpack("Q")
        for _ in range(n_kv):
            name = cur.string()
            vtype = cur.unpack("I")
            start = cur.pos
            cur.value(vtype)
            if name == key:
                return start, cur.pos, vtype
    raise KeyError(key)


def encode(value: int | float | bool | str, vtype: int) -> bytes:
    if vtype == _STRING:
        raw = str(value).encode()
        return struct.pack("<Q", len(raw)) + raw
    return struct.pack(_FORMATS[vtype], value)


def set_value(src: Path, dst: Path, key: str, value, vtype: int | None = None) -> Path:
    """Copy src to dst with metadata `key` set to `value` (of the key's own type unless given)."""
    start, end, old_type = value_span(src, key)
    new_type = old_type if vtype is None else vtype
    prefix = b"" if new_type == old_type else struct.pack("<I", new_type)
    # A changed type rewrites the type field too: it sits just before the value.
    type_at = start - 4 if new_type != old_type else start
    return splice(src, dst, type_at, end, prefix + encode(value, new_type))


def token_span(path: Path, index: int) -> tuple[int, int]:
    """(start, end) of vocabulary token `index`, length prefix included."""
    header = read_header(path)
    pos = header.array_offsets["tokenizer.ggml.tokens"]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for _ in range(index):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        return pos, pos + 8 + struct.unpack_from("<Q", buf, pos)[0]


def token_bytes(path: Path, index: int) -> bytes:
    start, end = token_span(path, index)
    with open(path, "rb") as f:
        f.seek(start + 8)
        return f.read(end - start - 8)


def set_token(src: Path, dst: Path, index: int, text: bytes) -> Path:
    """Copy src to dst with vocabulary token `index` replaced by `text`."""
    start, end = token_span(src, index)
    return splice(src, dst, start, end, struct.pack("<Q", len(text)) + text)


def splice(src: Path, dst: Path, start: int, end: int, new: bytes) -> Path:
    """Copy src to dst with bytes [start, end) of its header replaced; tensor data re-aligned."""
    header = read_header(src)
    alignment = int(header.metadata.get("general.alignment", 32))
    old_data = _pad(header.header_size, alignment)
    data = src.read_bytes()
    head = data[:start] + new + data[end:header.header_size]
    with open(dst, "wb") as f:
        f.write(head)
        f.write(bytes(_pad(len(head), alignment) - len(head)))
        f.write(memoryview(data)[old_data:])
    return dst


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def add_value(src: Path, dst: Path, key: str, value, vtype: int) -> Path:
    """Copy src to dst with one more metadata entry, `key` = `value`, after the last one."""
    with open(src, "rb") as f:
        n_kv = struct.unpack("<Q", f.read(24)[16:24])[0]
    tmp = dst.with_name(dst.name + ".tmp")
    end = _metadata_end(src)
    entry = encode(key, _STRING) + struct.pack("<I", vtype) + encode(value, vtype)
    splice(src, tmp, end, end, entry)
    with open(tmp, "r+b") as f:
        f.seek(16)
        f.write(struct.pack("<Q", n_kv + 1))
    tmp.replace(dst)
    return dst


def _metadata_end(path: Path) -> int:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        cur.pos = 4 + 4 + 8
        for _ in range(cur.unpack("Q")):
            cur.string()
            cur.value(cur.unpack("I"))
        return cur.pos
