"""The weights file every graph of an exported model refers to, and its manifest.

`weights.bin` holds each initializer's bytes at a 4 KiB-aligned offset (so ONNX Runtime can map
them rather than copy); `manifest.json` names each one (dtype, shape, offset, length), describes
each weight matrix (bits, block, offsets), and carries the export key and the weights file's size
and modification time. The manifest is a cache entry, so it is checked, never trusted: any value
out of place means "export again".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localinfer.backends.onnx.weights import Matrix

WEIGHTS = "weights.bin"
MANIFEST = "manifest.json"
ALIGN = 4096
MAX_MANIFEST = 16 << 20          # bytes: a real one is tens of kilobytes
_DTYPES = {"uint8": (np.uint8, 2), "float32": (np.float32, 1)}    # name -> (numpy, ONNX type)


@dataclass(frozen=True)
class MatrixInfo:
    rows: int
    cols: int
    bits: int                     # 4 or 8: MatMulNBits; 0: dense (stored transposed, "<name>.t")
    block: int
    offsets: bool                 # a "<name>.offsets" [blocks, rows] tensor exists
    exact: bool
    parts: tuple = ()             # a stacked matrix: ((GGUF name, rows), ...) from the top


class WeightWriter:
    """Appends initializers to a new weights file; `finish` writes the manifest."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._file = open(folder / WEIGHTS, "wb")
        self._pos = 0
        self.tensors: dict[str, list] = {}
        self.matrices: dict[str, dict] = {}

    def add_matrix(self, name: str, m: Matrix, parts: list[tuple[str, int]] = ()) -> None:
        if m.bits == 0:
            self._add(name + ".t", np.ascontiguousarray(m.dense.T))
        else:
            self._add(name + ".codes", m.codes)
            self._add(name + ".scales", m.scales)
            if m.offsets is not None:
                self._add(name + ".offsets", np.ascontiguousarray(m.offsets.T))
        self.matrices[name] = {"rows": m.rows, "cols": m.cols, "bits": m.bits, "block": m.block,
                               "offsets": m.offsets is not None, "exact": m.exact,
                               "parts": [list(p) for p in parts]}

    def add_vector(self, name: str, values: np.ndarray) -> None:
        self._add(name, np.ascontiguousarray(values, dtype=np.float32))

    def _add(self, name: str, array: np.ndarray) -> None:
        pad = -self._pos % ALIGN
        self._file.write(b"\0" * pad)
        self._pos += pad
        data = np.ascontiguousarray(array)
        self._file.write(data.tobytes())
        self.tensors[name] = [data.dtype.name, list(data.shape), self._pos, data.nbytes]
        self._pos += data.nbytes

    def finish(self, key: str, extra: dict) -> dict:
        """Close the weights file and write the manifest that vouches for it."""
        self._file.close()
        st = (self.folder / WEIGHTS).stat()
        manifest = {"key": key, "weights": {"size": st.st_size, "mtime_ns": st.st_mtime_ns},
                    "tensors": self.tensors, "matrices": self.matrices, **extra}
        (self.folder / MANIFEST).write_text(json.dumps(manifest))
        return manifest

    def abort(self) -> None:
        self._file.close()


class WeightIndex:
    """A checked manifest: matrix facts and the initializers the graph builder refers to."""

    def __init__(self, manifest: dict) -> None:
        self.manifest = manifest
        self.key: str = manifest["key"]
        self._matrices = {n: MatrixInfo(**{**m, "parts": tuple(tuple(p) for p in m["parts"])})
                          for n, m in manifest["matrices"].items()}

    def matrix(self, name: str) -> MatrixInfo:
        return self._matrices[name]

    def stacked(self, names: list[str]) -> str | None:
        """The stacked matrix holding exactly these GGUF matrices in this order, if one was made."""
        for stack, m in self._matrices.items():
            if [p[0] for p in m.parts] == names:
                return stack
        return None

    def vector(self, folder: Path, name: str) -> np.ndarray:
        """A float32 tensor read back from the weights file (the rope factors)."""
        _, shape, offset, length = self.manifest["tensors"][name]
        return np.fromfile(folder / WEIGHTS, np.float32, length // 4, offset=offset).reshape(shape)

    def inexact(self) -> list[str]:
        """The GGUF matrices re-quantized at 8 bits rather than carried over exactly."""
        return sorted(part for n, m in self._matrices.items() if not m.exact
                      for part in ([p[0] for p in m.parts] or [n]))

    def tensor_proto(self, name: str):
        """The initializer `name`, its data left in the weights file (external data)."""
        from onnx import TensorProto
        dtype, shape, offset, length = self.manifest["tensors"][name]
        t = TensorProto()
        t.name = name
        t.data_type = _DTYPES[dtype][1]
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", WEIGHTS), ("offset", offset), ("length", length)):
            entry = t.external_data.add()
            entry.key, entry.value = key, str(value)
        return t


def read_index(folder: Path, key: str, names: set[str]) -> WeightIndex | None:
    """The folder's index when its manifest is whole, has this key, describes exactly the matrices
    and vectors `names`, and its weights file is the one it was written with; else None."""
    try:
        path = folder / MANIFEST
        if path.stat().st_size > MAX_MANIFEST:
            return None
        manifest = json.loads(path.read_text())
        st = (folder / WEIGHTS).stat()
    except (OSError, ValueError):
        return None
    try:
        ok = _valid(manifest, key, names, st.st_size, st.st_mtime_ns)
    except (TypeError, KeyError, ValueError, AttributeError):
        ok = False
    return WeightIndex(manifest) if ok else None


def _valid(manifest, key: str, names: set[str], size: int, mtime_ns: int) -> bool:
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return False
    if manifest["weights"] != {"size": size, "mtime_ns": mtime_ns}:
        return False               # rewritten or cut short since the manifest vouched for it
    tensors, matrices = manifest["tensors"], manifest["matrices"]
    if not all(_tensor_ok(t, size) for t in tensors.values()):
        return False
    covered = {n for n in tensors if n in names}           # the vectors
    for name, m in matrices.items():
        MatrixInfo(**m)            # exactly the expected fields, or TypeError
        stored = [".t"] if m["bits"] == 0 else [".codes", ".scales"] + [".offsets"] * m["offsets"]
        if not all(name + p in tensors for p in stored):
            return False
        parts = m["parts"]
        if parts and sum(rows for _, rows in parts) != m["rows"]:
            return False
        covered |= {part for part, _ in parts} if parts else {name}
    return covered == names


def _tensor_ok(entry, size: int) -> bool:
    dtype, shape, offset, length = entry
    if dtype not in _DTYPES or not all(type(d) is int and d >= 0 for d in shape):
        return False
    if type(offset) is not int or type(length) is not int or offset < 0:
        return False
    return offset + length <= size and length == math.prod(shape) * np.dtype(dtype).itemsize
