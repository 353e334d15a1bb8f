"""Load a located model file on the backend that suits it: the last step before decoding."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from localinfer import backends
from localinfer.backends import LoadOptions, Session
from localinfer.models.gguf_header import read_header
from localinfer.models.refs import ModelRef


@dataclass
class LoadedModel:
    ref: ModelRef
    path: Path
    session: Session
    backend: str
    backend_reason: str
    load_s: float


def load_model(ref: ModelRef, path: Path, *, backend: str, options: LoadOptions) -> LoadedModel:
    arch = str(read_header(path).metadata.get("general.architecture", "")) or None
    chosen, choice = backends.select(backend, arch, path)
    start = time.perf_counter()
    session = chosen.load(path, options)
    return LoadedModel(ref, path, session, choice.backend, choice.reason,
                       time.perf_counter() - start)
