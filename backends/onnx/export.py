"""GGUF -> ONNX export, cached in the store: one weights file per model file, graphs per form.

`<models>/.onnx/<stem>-<path hash>/` holds weights.bin and manifest.json (store.py) and one small
graph file per form and accuracy level (forms.py), all referring to the same weights. The export
key is made from the GGUF file's identity (path, size, modification time) and the exporter's
version: a folder with another key, a manifest that does not check out, or a graph that does not
parse or names another key is built again, never trusted. A new export is written into a temporary
folder and renamed into place, so a reader sees the old export or the whole new one, never half of
one. Building, replacing and discarding an export hold its lock (`.locks/<folder>.lock`, flock),
so of two processes exporting the same model at once one builds and the other waits and then
uses that export: a second build would rename the first away under the process about to read it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from localinfer.backends.onnx import forms as onnx_forms, weights as onnx_weights
from localinfer.backends.onnx.arch import Spec
from localinfer.backends.onnx.store import WeightIndex, WeightWriter, read_index
from localinfer.errors import ModelLoadError
from localinfer.gguf.header import Header
from localinfer.models.store import HAS_LOCKS

EXPORTER_VERSION = 3          # bump when the weights or graphs change: old exports become stale
MAX_GRAPH_BYTES = 64 << 20    # a graph file holds no weights: a few hundred kilobytes
_ABANDONED_S = 24 * 3600


@dataclass(frozen=True)
class Form:
    """Which graph: dynamic, or static with `tokens` per call and `slots` cache rows."""

    kind: str = "dynamic"
    accuracy: int = 4           # MatMulNBits accuracy_level: 0 exact float, 4 int8 activations
    tokens: int = 0
    slots: int = 0

    @property
    def file_name(self) -> str:
        if self.kind == "dynamic":
            return f"dynamic-a{self.accuracy}.onnx"
        return f"static-a{self.accuracy}-t{self.tokens}-c{self.slots}.onnx"


def export_root() -> Path:
    """Where exports live: beside the models they come from."""
    from localinfer import settings
    return settings.load().models_dir / ".onnx"


def export_key(path: Path) -> str:
    st = path.stat()
    identity = {"source": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "exporter": EXPORTER_VERSION}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def export_dir(path: Path, cache_dir: Path) -> Path:
    """One folder per source file: a new export replaces the stale one."""
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem)[:64].lstrip(".") or "model"
    return cache_dir / f"{stem}-{where}"


def ensure_weights(path: Path, header: Header, spec: Spec, cache_dir: Path, *,
                   note: Callable[[str], None] | None = None) -> tuple[Path, WeightIndex]:
    """The export folder of `path` and its checked index, exporting the weights when needed."""
    folder, key = export_dir(path, cache_dir), export_key(path)
    names = set(spec.tensors())
    index = read_index(folder, key, names)
    if index is not None:
        return folder, index
    with export_lock(folder):
        index = read_index(folder, key, names)      # another process may have made it meanwhile
        if index is None:
            if note:
                note(f"exporting {path.name} to ONNX (once per model file)")
            _build(path, header, spec, folder, key)
            index = read_index(folder, key, names)
    if index is None:
        raise ModelLoadError(f"the ONNX export of {path.name} in {folder} did not check out "
                             "after writing it; is the disk full?")
    return folder, index


def ensure_graph(folder: Path, index: WeightIndex, spec: Spec, form: Form) -> Path:
    """The graph file of `form`, written when missing or not this export's."""
    target = folder / form.file_name
    if _graph_ok(target, index.key, form):
        return target
    with export_lock(folder):
        if not _graph_ok(target, index.key, form):
            _write_graph(target, index, spec, form)
    return target


def _write_graph(target: Path, index: WeightIndex, spec: Spec, form: Form) -> None:
    meta = {"localinfer.key": index.key, "localinfer.form": form.file_name}
    if form.kind == "dynamic":
        model = onnx_forms.dynamic(spec, index, form.accuracy, meta)
    else:
        model = onnx_forms.static(spec, index, form.accuracy, form.tokens, form.slots, meta)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_bytes(model.SerializeToString())
        for compiled in target.parent.glob(f"{target.stem}.*.ctx.onnx"):   # an NPU's old build
            compiled.unlink(missing_ok=True)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(f"cannot write the ONNX graph {target}: {e}") from e


@contextlib.contextmanager
def export_lock(folder: Path) -> Iterator[None]:
    """Hold the lock of one model's export folder (released when the file closes, so also when
    the process dies). Without advisory locks (Windows) the renames alone keep readers safe."""
    lock_path = folder.parent / ".locks" / f"{folder.name}.lock"
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        raise ModelLoadError(f"cannot write the ONNX export under {folder.parent}: {e}") from e
    with open(fd, "r+b") as handle:
        if HAS_LOCKS:
            import fcntl
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def discard(folder: Path) -> None:
    """Remove an export ONNX Runtime refused, so the next load builds it again."""
    old = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.old")
    with export_lock(folder):
        try:
            os.rename(folder, old)
        except OSError:
            return
    shutil.rmtree(old, ignore_errors=True)


# -- building --------------------------------------------------------------------------------------
def _build(path: Path, header: Header, spec: Spec, folder: Path, key: str) -> None:
    _sweep(folder)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.mkdir(parents=True)
        start = time.perf_counter()
        writer = WeightWriter(tmp)
        try:
            write_weights(path, header, spec, writer)
        except BaseException:
            writer.abort()
            raise
        writer.finish(key, {"source": str(path.resolve()), "exporter": EXPORTER_VERSION,
                            "seconds": round(time.perf_counter() - start, 2)})
        _install(tmp, folder)
    except OSError as e:
        raise ModelLoadError(f"cannot write the ONNX export of {path.name} under "
                             f"{folder.parent}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_weights(path: Path, header: Header, spec: Spec, writer: WeightWriter) -> None:
    """Every tensor the graphs read, converted one at a time (peak memory: the largest one).

    Matrices that read the same input (Q, K, V; gate, up) are stacked into one where their blocks
    agree: one MatMulNBits and one offset term instead of three, fewer kernels per token."""
    alignment = int(header.metadata.get("general.alignment", 32))
    data_start = -(-header.header_size // alignment) * alignment
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {t.name: t for t in header.tensors}
    shapes = spec.tensors()

    def read(name: str):
        t = tensors[name]
        data = raw[data_start + t.offset:data_start + t.offset + t.n_bytes]
        try:
            if len(shapes[name]) == 1:
                return onnx_weights.vector(t.type_name, data, shapes[name][0])
            return _matrix(spec, name, t.type_name, data, shapes[name])
        except onnx_weights.UnreadableTensor as e:
            raise ModelLoadError(f"cannot export {path.name} to ONNX: tensor {name} holds {e}, "
                                 "which the exporter does not read; use --backend llama.cpp") from None

    grouped = {n: names for names in stacks(spec) for n in names}
    for name in shapes:
        if name in grouped:
            if name == grouped[name][0]:
                _add_stack(writer, grouped[name], [read(n) for n in grouped[name]])
        elif len(shapes[name]) == 1:
            writer.add_vector(name, read(name))
        else:
            writer.add_matrix(name, read(name))


def stacks(spec: Spec) -> list[list[str]]:
    """Groups of matrices that read the same input, in the order their outputs are split."""
    return [[f"blk.{i}.{w}.weight" for w in group] for i in range(spec.n_layer)
            for group in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))]


def stack_name(names: list[str]) -> str:
    return names[0].rsplit(".", 2)[0] + "." + "+".join(n.split(".")[-2] for n in names) + ".weight"


def _add_stack(writer: WeightWriter, names: list[str], parts: list) -> None:
    stacked = onnx_weights.stack_rows(parts)
    if stacked is None:                 # blocks differ (Q4_K beside Q6_K): one matrix each
        for name, m in zip(names, parts):
            writer.add_matrix(name, m)
        return
    writer.add_matrix(stack_name(names), stacked, [(n, m.rows) for n, m in zip(names, parts)])


def _matrix(spec: Spec, name: str, type_name: str, data: np.ndarray, shape) -> onnx_weights.Matrix:
    cols, rows = shape
    m = onnx_weights.matrix(type_name, data, rows, cols)
    if spec.arch == "llama" and re.fullmatch(r"blk\.\d+\.attn_[qk]\.weight", name):
        m = onnx_weights.take_rows(m, unpermute_rows(rows // spec.head_dim, spec.head_dim))
    return m


def unpermute_rows(n_head: int, head_dim: int) -> np.ndarray:
    """Row order undoing the GGUF converter's Q/K permutation: llama.cpp rotates adjacent pairs
    (2i, 2i+1), GroupQueryAttention rotates halves (i, i + head_dim/2)."""
    rows = np.arange(n_head * head_dim).reshape(n_head, head_dim // 2, 2)
    return rows.swapaxes(1, 2).reshape(-1)


def _install(tmp: Path, folder: Path) -> None:
    """Put the finished export in place of whatever was there."""
    old = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.old")
    try:
        os.rename(folder, old)
    except FileNotFoundError:
        old = None
    try:
        os.rename(tmp, folder)
    except OSError:
        pass          # without locks another process may have installed its export first
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _graph_ok(target: Path, key: str, form: Form) -> bool:
    import onnx
    try:
        if target.stat().st_size > MAX_GRAPH_BYTES:
            return False
        model = onnx.load(str(target), load_external_data=False)
    except Exception:          # missing, unreadable, or not a protobuf: build it again
        return False
    meta = {p.key: p.value for p in model.metadata_props}
    return meta.get("localinfer.key") == key and meta.get("localinfer.form") == form.file_name


def _sweep(folder: Path) -> None:
    """Temporary folders of exports whose writer died (killed mid-export) are removed."""
    pattern = re.compile(rf"\.{re.escape(folder.name)}\.(\d+)\.[0-9a-f]{{8}}\.(tmp|old)")
    try:
        entries = list(folder.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and _abandoned(entry, int(match[1])):
            shutil.rmtree(entry, ignore_errors=True)


def _abandoned(entry: Path, pid: int) -> bool:
    """Its writer is gone, or (pids are reused) it has not changed for a day."""
    try:
        if time.time() - entry.lstat().st_mtime > _ABANDONED_S:
            return True
    except OSError:
        return False
    if os.name != "posix" or pid == os.getpid():
        return False          # on Windows os.kill(pid, 0) would end the process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
