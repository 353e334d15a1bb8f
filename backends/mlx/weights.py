"""A GGUF file's tensors as MLX arrays, under their GGUF names.

`mx.load` reads F32, F16, Q4_0, Q4_1 and Q8_0 files itself. It refuses a file holding any other
type (every K-quant file), so those are converted tensor by tensor (see convert.py) and the result
is cached in the store as safetensors: the next load is an `mx.load` of that file. The cache file
carries a key made from the source's identity and the converter version; a stale key, a truncated
or unreadable file, or missing tensors all mean "convert again", never "trust it".
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from pathlib import Path

import numpy as np

from localinfer.backends.mlx import convert as mlx_convert
from localinfer.gguf.header import Header

CONVERTER_VERSION = 1         # bump when convert.py's output changes: old cache files become stale
NATIVE_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}
_KEY = "localinfer.conversion_key"


def load(path: Path, header: Header, cache_dir: Path) -> tuple[dict, str]:
    """(arrays by GGUF name, how they were obtained: "native" or the conversion key)."""
    import mlx.core as mx
    if {t.type_name for t in header.tensors} <= NATIVE_TYPES:
        return mx.load(str(path)), "native"
    key = conversion_key(path)
    target = cache_path(path, cache_dir)
    arrays = _read_cached(target, key, header)
    if arrays is None:
        arrays = {name: mx.array(a) for name, a in convert(path, header).items()}
        _write_atomic(target, arrays, key)
    return arrays, key


def conversion_key(path: Path) -> str:
    st = path.stat()
    identity = {"source": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "converter": CONVERTER_VERSION, "group": mlx_convert.GROUP}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def cache_path(path: Path, cache_dir: Path) -> Path:
    """One cache file per source file: a new conversion replaces the stale one in place."""
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    return cache_dir / f"{path.stem}-{where}.safetensors"


def convert(path: Path, header: Header) -> dict[str, np.ndarray]:
    """Every tensor of the file as numpy arrays in MLX layout (see convert.py)."""
    alignment = int(header.metadata.get("general.alignment", 32))
    data_start = -(-header.header_size // alignment) * alignment
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    for t in header.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))      # ggml lists the row length first
        data = raw[data_start + t.offset:data_start + t.offset + t.n_bytes]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        out.update(mlx_convert.convert_tensor(t.name, data.reshape(rows, -1), t.type_name, shape))
    return out


def expected_names(header: Header) -> set[str]:
    names = set()
    for t in header.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.type_name in ("F32", "F16", "BF16") or not mlx_convert.is_groupable(shape):
            names.add(t.name)
        else:
            base = t.name.removesuffix(".weight")
            names |= {t.name, f"{base}.scales", f"{base}.biases"}
    return names


def _read_cached(target: Path, key: str, header: Header) -> dict | None:
    import mlx.core as mx
    if not _header_ok(target, key):
        return None
    try:
        arrays = mx.load(str(target))
    except (RuntimeError, ValueError, OSError):
        return None
    return arrays if set(arrays) == expected_names(header) else None


def _header_ok(target: Path, key: str) -> bool:
    """The safetensors header parses, names our key, and the file is as long as it says."""
    try:
        with open(target, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return False
            head = json.loads(f.read(n))
        size = target.stat().st_size
    except (OSError, ValueError, struct.error):
        return False
    if not isinstance(head, dict) or head.get("__metadata__", {}).get(_KEY) != key:
        return False
    ends = [v["data_offsets"][1] for k, v in head.items() if k != "__metadata__"]
    return size == 8 + n + max(ends, default=0)


def _write_atomic(target: Path, arrays: dict, key: str) -> None:
    """Temporary file + rename: a reader sees the old file or the whole new one, never a part."""
    import mlx.core as mx
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp.safetensors")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(tmp), arrays, metadata={_KEY: key})
        os.replace(tmp, target)
    except (OSError, RuntimeError):   # read-only or full: run from memory, convert again next time
        tmp.unlink(missing_ok=True)
