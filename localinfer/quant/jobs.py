"""`localinfer quantize`: pick the source, name the result, show the plan or carry it out."""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from localinfer.cli import console
from localinfer.fit import memory
from localinfer.models import refs, store_sweep
from localinfer.models.store import Store
from localinfer.quant import quantize

if TYPE_CHECKING:
    from localinfer.quant import imatrix as imatrix_mod
@dataclass(frozen=True)
class Job:
    source: Path
    name: str                 # store name of the model
    qtype: str
    output: Path
    store: Store | None = None   # None when -o points elsewhere


def prepare(model: str, qtype: str, output: Path | None, *, offline: bool) -> Job:
    """Resolve the source model (pulling it if needed) and where the result goes."""
    qtype = quantize.parse_type(qtype)          # a bad type is refused before anything is pulled
    source, name = _source(model, qtype, offline=offline)
    if output is not None:
        return Job(source, name, qtype, output.expanduser())
    _, _, store = refs.context()
    return Job(source, name, qtype, store.path_for(name, qtype), store)


def _source(model: str, qtype: str, *, offline: bool) -> tuple[Path, str]:
    if refs.looks_like_path(model):     # a file: no catalogue to read (a hundredth of a second)
        path = refs.parse_ref(model, None).path
        assert path is not None
        return path, quantize.store_name_for(path)
    _, cat, store = refs.context()
    ref = refs.parse_ref(model, cat)
    if ref.spec is None:
        assert ref.path is not None
        return ref.path, quantize.store_name_for(ref.path)
    if ref.path is not None:                    # a locally made NAME:QUANT
        return ref.path, ref.spec.name
    if ":" not in model:                        # no quant named: the most precise one on disk
        on_disk = {m.quant: m.path for m in store.installed()
                   if m.name == ref.spec.name and m.quant != qtype}   # not the target itself
        best = quantize.best_on_disk(list(on_disk))
        if best:
            return on_disk[best], ref.spec.name
    path = refs.locate(ref, store, offline=offline, progress=console.interactive(),
                         notify=console.note)
    return path, ref.spec.name


def load_imatrix(path: Path | None) -> imatrix_mod.Imatrix | None:
    if path is None:
        return None
    from localinfer.quant import imatrix as imatrix_mod
    return imatrix_mod.load(path.expanduser())


def dry_run(job: Job, imatrix: imatrix_mod.Imatrix | None, *, ctx_sizes: tuple[int, ...],
            as_json: bool) -> None:
    """Print what the quantization would produce: exact size and memory needs; write nothing."""
    if imatrix is not None:
        quantize.check_imatrix(imatrix, quantize.read_header(job.source))
    plan = quantize.plan(job.source, job.qtype, imatrix=imatrix)
    facts = planned_facts(memory.facts_from_file(job.source), plan)
    needs = {ctx: memory.estimate(facts, memory.Request(ctx)) for ctx in ctx_sizes}
    report = {"source": str(job.source), "type": job.qtype, "output": str(job.output),
              "file_size": plan.file_size, "needs_imatrix": plan.needs_imatrix,
              "requantizes": plan.requantized_types,
              "tensor_types": dict(Counter(t.target_type for t in plan.tensors)),
              "memory": {str(ctx): e.as_dict() for ctx, e in needs.items()}}
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        return
    rows = [["output", str(job.output)], ["type", job.qtype],
            ["file size", f"{console.human_size(plan.file_size)} ({plan.file_size:,} bytes)"],
            ["tensors", ", ".join(f"{n} {t}" for t, n in report["tensor_types"].items())]]
    for ctx, e in needs.items():
        rows.append([f"memory at ctx {ctx}", describe_estimate(e)])
    if plan.requantized_types:
        rows.append(["requantizes", ", ".join(plan.requantized_types) + " (needs --allow-requantize)"])
    if plan.needs_imatrix:
        rows.append(["imatrix", "required (--imatrix FILE)"])
    console.print_table(["QUANTIZE", "DRY RUN"], rows)


def describe_estimate(e: memory.Estimate) -> str:
    mb = lambda n: f"{n / 1e6:.0f}"   # noqa: E731 - a local formatter
    return (f"{console.human_size(e.total)} (weights {mb(e.weights)} + KV {mb(e.kv_cache)} + "
            f"compute {mb(e.compute)} + overhead {mb(e.overhead)} MB)")


def planned_facts(source: memory.ModelFacts, plan: quantize.QuantPlan) -> memory.ModelFacts:
    """The memory facts of the file a plan would write (same model, the plan's sizes)."""
    # The plan knows target types but not shapes; count the types the CPU backend repacks.
    repackable = sum(t.size for t in plan.tensors if t.target_type in memory.REPACKED_X86_AVX2
                     and not t.name.startswith("token_embd"))
    return memory.with_quant_size(source, plan.file_size, repackable)


def run(job: Job, imatrix: imatrix_mod.Imatrix | None, *, threads: int, allow_requantize: bool,
        force: bool) -> None:
    with _writing(job), progress_bar(console.interactive()) as progress:
        size = quantize.quantize_file(job.source, job.output, job.qtype, threads=threads,
                                      allow_requantize=allow_requantize, imatrix=imatrix,
                                      progress=progress, force=force, warn=console.warn)
    label = f"{job.name}:{job.qtype}" if job.store else str(job.output)
    console.note(f"{label}: {console.human_size(size)} written to {job.output}")


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


@contextlib.contextmanager
def progress_bar(enabled: bool) -> Iterator[quantize.Progress | None]:
    """A bar per tensor on a terminal; nothing on a pipe."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    bar = Progress(TextColumn("quantizing"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.description}"),
                   console=console.stderr(), transient=True)
    with bar:
        task = bar.add_task("", total=None)

        def update(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=name)
        yield update

