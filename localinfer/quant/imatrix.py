"""Importance matrices for the very-low-bit quants (IQ1/IQ2 family), read as llama-quantize reads them.

Two formats exist: the GGUF one written by current `llama-imatrix` (per tensor `NAME.in_sum2` and
`NAME.counts`) and the legacy `.dat` one. Both become one float vector per weight tensor: the mean
squared activation of each input column, which the quantizer uses to weight its rounding error.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localinfer.errors import UsageError


@dataclass(frozen=True)
class Imatrix:
    path: Path
    data: dict[str, np.ndarray]
    datasets: tuple[str, ...]
    chunk_count: int

    def kv_overrides(self, shown_path: str) -> list[tuple[str, int | str]]:
        """The provenance keys llama-quantize writes into the quantized file, in its order."""
        pairs: list[tuple[str, int | str]] = [("quantize.imatrix.file", shown_path)]
        if self.datasets:
            pairs.append(("quantize.imatrix.dataset", self.datasets[0]))
        pairs.append(("quantize.imatrix.entries_count", len(self.data)))
        if self.chunk_count > 0:
            pairs.append(("quantize.imatrix.chunks_count", self.chunk_count))
        return pairs


def load(path: Path) -> Imatrix:
    """Read an importance matrix; a clear UsageError for anything that is not one."""
    if not path.is_file():
        raise UsageError(f"no such imatrix file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    try:
        return _load_gguf(path) if magic == b"GGUF" else _load_legacy(path)
    except (struct.error, ValueError, KeyError, IndexError) as e:
        raise UsageError(f"{path} is not a valid importance matrix ({e})") from e


def _load_gguf(path: Path) -> Imatrix:
    from gguf import GGUFReader
    reader = GGUFReader(path)
    sums, counts = {}, {}
    for t in reader.tensors:
        if t.name.endswith(".in_sum2"):
            sums[t.name[:-len(".in_sum2")]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
        elif t.name.endswith(".counts"):
            counts[t.name[:-len(".counts")]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not sums:
        raise ValueError("no .in_sum2 tensors")
    data = {name: _normalise(s, counts[name]) for name, s in sums.items()}
    fields = reader.fields
    datasets = tuple(fields["imatrix.datasets"].contents()) if "imatrix.datasets" in fields else ()
    chunks = int(fields["imatrix.chunk_count"].contents()) if "imatrix.chunk_count" in fields else 0
    return Imatrix(path, data, datasets, chunks)


def _normalise(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    # Per expert: sums / count, or ones where an expert never saw a token (as llama-quantize does).
    counts = np.rint(counts)
    rows = sums.reshape(len(counts), -1)
    out = np.ones_like(rows)
    seen = counts > 0
    out[seen] = rows[seen] / counts[seen, None].astype(np.float32)
    return out.reshape(-1)


def _load_legacy(path: Path) -> Imatrix:
    raw = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, raw, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    (n_entries,) = take("i")
    if n_entries < 1:
        raise ValueError("no entries")
    data = {}
    for _ in range(n_entries):
        (length,) = take("i")
        name = raw[pos:pos + length].decode("utf-8")
        pos += length
        ncall, nval = take("ii")
        if nval < 1:
            raise ValueError(f"entry {name} has no values")
        values = np.frombuffer(raw, dtype="<f4", count=nval, offset=pos).astype(np.float32)
        pos += 4 * nval
        data[name] = values / ncall if ncall > 0 else values
    chunks, datasets = 0, ()
    if pos + 8 <= len(raw):           # optional trailer: chunk count and dataset name
        chunks, length = take("ii")
        if length > 0:
            datasets = (raw[pos:pos + length].decode("utf-8", "replace"),)
    return Imatrix(path, data, datasets, chunks)


def save_legacy(path: Path, data: dict[str, np.ndarray], *, ncall: int = 1) -> None:
    """Write the legacy format (used by tests to make a small, valid imatrix)."""
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(data)))
        for name, values in data.items():
            encoded = name.encode()
            f.write(struct.pack("<i", len(encoded)) + encoded)
            f.write(struct.pack("<ii", ncall, values.size))
            f.write((np.asarray(values, dtype="<f4") * ncall).tobytes())
