"""Load a located model file on the backend that suits it: the last step before decoding."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from localinfer import backends
from localinfer.backends import LoadOptions, Session
from localinfer.errors import UsageError
from localinfer.gguf.header import read_header
from localinfer.gguf.split import split_count
from localinfer.models.refs import ModelRef


@dataclass
class LoadedModel:
    ref: ModelRef
    path: Path
    session: Session
    backend: str
    backend_reason: str
    load_s: float
    options: LoadOptions | None = None      # as it was loaded with


def load_model(ref: ModelRef, path: Path, *, backend: str, options: LoadOptions) -> LoadedModel:
    header = read_header(path)
    arch = str(header.metadata.get("general.architecture", "")) or None
    split = split_count(header) > 1
    if split:
        backend = _split_backend(path, backend)
    chosen, choice = backends.select(backend, arch, path)
    loading = options       # LoadedModel keeps `options` as asked: reuse_or_load compares them
    if options.mmproj:
        from localinfer.engine.media import load_projector
        loading = replace(options, mmproj=load_projector(options.mmproj, path, ref.display,
                                                         choice.backend))
    if split:
        choice = backends.Choice(choice.backend, "only llama.cpp reads a model split in parts")
    start = time.perf_counter()
    session = chosen.load(path, loading)
    return LoadedModel(ref, path, session, choice.backend, choice.reason,
                       time.perf_counter() - start, options)


def _split_backend(path: Path, requested: str) -> str:
    """llama.cpp for a model split in parts: MLX and ONNX read tensors from one file."""
    if requested not in ("auto", "llama.cpp"):
        raise UsageError(f"{path.name} is one part of a split model, which only the llama.cpp "
                         "backend reads; use --backend llama.cpp (or auto)")
    return "llama.cpp"
