"""A quantization job: the source model, the name and place of the result, its plan, and writing it
into the store as every store writer does. `cli.measure` shows the plan or reports the result."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from localinfer.models import refs, store_sweep
from localinfer.models.store import Store
from localinfer.quant import quantize

if TYPE_CHECKING:
    from localinfer.quant.imatrix import Imatrix

Notify = Callable[[str], None]


@dataclass(frozen=True)
class Job:
    source: Path
    name: str                 # store name of the model
    qtype: str
    output: Path
    store: Store | None = None   # None when -o points elsewhere


def prepare(model: str, qtype: str, output: Path | None, *, offline: bool, progress: bool = False,
            notify: Notify = lambda _: None) -> Job:
    """Resolve the source model (pulling it if needed, with a download bar when `progress`) and
    where the result goes."""
    qtype = quantize.parse_type(qtype)          # a bad type is refused before anything is pulled
    source, name = _source(model, qtype, offline=offline, progress=progress, notify=notify)
    if output is not None:
        return Job(source, name, qtype, output.expanduser())
    store = refs.model_store()
    return Job(source, name, qtype, store.path_for(name, qtype), store)


def _source(model: str, qtype: str, *, offline: bool, progress: bool,
            notify: Notify) -> tuple[Path, str]:
    if refs.looks_like_path(model):     # a file: no catalogue to read (a hundredth of a second)
        path = refs.parse_ref(model, None).path
        assert path is not None
        return path, quantize.store_name_for(path)
    _, cat, store = refs.context()
    ref = refs.parse_ref(model, cat, offline=offline, notify=notify)
    if ref.spec is None:
        assert ref.path is not None
        return ref.path, quantize.store_name_for(ref.path)
    if ref.path is not None:                    # a locally made NAME:QUANT
        return ref.path, ref.spec.name
    if not refs.names_quant(model):             # no quant named: the most precise one on disk
        on_disk = {m.quant: m.path for m in store.installed()
                   if m.name == ref.spec.name and m.quant != qtype}   # not the target itself
        best = quantize.best_on_disk(list(on_disk))
        if best:
            return on_disk[best], ref.spec.name
    path = refs.locate(ref, store, offline=offline, progress=progress, notify=notify)
    return path, ref.spec.name


def load_imatrix(path: Path | None) -> Imatrix | None:
    if path is None:
        return None
    from localinfer.quant import imatrix
    return imatrix.load(path.expanduser())


def plan(job: Job, imatrix: Imatrix | None) -> quantize.QuantPlan:
    """What the quantization would produce, exactly (llama.cpp's own dry run); writes nothing."""
    if imatrix is not None:
        quantize.check_imatrix(imatrix, quantize.read_header(job.source))
    return quantize.plan(job.source, job.qtype, imatrix=imatrix)


def write(job: Job, imatrix: Imatrix | None, *, threads: int, allow_requantize: bool, force: bool,
          progress: quantize.Progress | None, warn: Notify) -> int:
    """Quantize into job.output; returns the size written."""
    with _writing(job):
        return quantize.quantize_file(job.source, job.output, job.qtype, threads=threads,
                                      allow_requantize=allow_requantize, imatrix=imatrix,
                                      progress=progress, force=force, warn=warn)


@contextlib.contextmanager
def _writing(job: Job) -> Iterator[None]:
    """Into the store: sweep what killed runs left, and hold the lock for this name and type
    while writing, as every store writer does (a second run waits, then finds the file)."""
    if job.store is None:
        yield
        return
    store_sweep.sweep(job.store)
    with job.store.lock(job.name, job.qtype):
        yield
