"""The model pool's real plan and load (server/pool.py): a name fitted as `serve` fits its model,
its memory need from the fit's estimate, and the model loaded as a batch under its own scheduler.

A model with a projector beside its file (`run`'s and `chat`'s, engine/media.py: the catalogue's,
pulled with the model, or an mmproj*.gguf beside a local one) is served with it: images and
audio are then answered (engine/scheduler_media.py), and the projector's memory counts in its fit
and its need as in `run`'s fit. A file there that is not a projector is left out with a note.

Every model is fitted against the pool's whole budget (as if alone: the pool makes the room), so
the budget is fixed once, when the pool is made (`pooled`): the RAM free later is less by what
the pool itself holds, and a fit that read it again would shrink or refuse the next model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from localinfer.backends import BatchSession, context_length
from localinfer.errors import DoesNotFit
from localinfer.fit import auto, memory, rules
from localinfer.fit.options import FitOptions, Reporter
from localinfer.models.refs import ModelRef
from localinfer.pipeline import load as pipeline
from localinfer.server.embedder import Embeddings, pinned
from localinfer.server.pool_state import Need, Plan, TooLarge
from localinfer.server.worker import Worker


def pooled(fit: FitOptions) -> tuple[FitOptions, Need, Need]:
    """(the fit options every model of the pool is fitted with, the pool's budget, the process's
    overhead). The budget is --memory's (or LOCALINFER_MEMORY_BUDGET, else the RAM available now
    less headroom) and the GPU's free memory less headroom, as `run` finds them; the overhead is
    the runtime's share of every `run`'s estimate, which a process of many models pays once."""
    _, budget = auto.machine_and_budget(fit.memory)
    return (replace(fit, memory=str(budget.ram)), Need(budget.ram, budget.vram),
            Need(memory.RUNTIME_BASE))


@dataclass
class ServedModel:
    """One loaded model: its batch session, the worker that runs its requests, and what the
    endpoints say of it (its file, its memory need, the names a request may call it by)."""

    name: str
    ref: ModelRef
    batch: BatchSession
    worker: Worker
    path: Path | None = None
    need: Need | None = None
    names: tuple[str, ...] = ()
    embeddings: Embeddings | None = None     # opened on its first embeddings request

    @property
    def n_ctx(self) -> int:
        return self.batch.n_ctx

    @property
    def session(self):
        return self.batch.session

    def close(self) -> None:
        """The worker ends (the pool unloads only models no request holds), then the model."""
        self.worker.stop()
        if self.embeddings is not None:
            self.embeddings.close()
        self.batch.close()
        _return_heap()


@dataclass(frozen=True)
class Loader:
    """`plan` and `load` for a Pool: each model fitted as `serve MODEL` fits it (`fit`, from
    `pooled`), `parallel` requests decoded together and `queue` more waiting, per model."""

    fit: FitOptions
    parallel: int = 4
    queue: int = 64
    backend: str = "auto"
    threads: int = 0
    engine_log: bool = False
    use_cache: bool = True
    report: Reporter = Reporter()
    log: Callable[[str], None] = print      # an embeddings load's failure

    def key(self, name: str) -> str:
        """The name the pool holds a model under, the same for every name of one model (an
        alias, another case): with its variant when the name picks one (NAME:QUANT, a file),
        else the model's own (the fit picks the variant). `plan` takes it as a name."""
        named = pipeline.name(name, self.fit, self.report)
        if named.ref.path is not None:
            return str(named.ref.path.resolve())
        return named.ref.display if named.chosen else named.ref.spec.display_name

    def describing(self) -> Loader:
        """This loader as /api/show plans with it: never a download, never a quantization."""
        return replace(self, fit=replace(self.fit, offline=True, quantize_to_fit=False))

    def on_disk(self, name: str) -> None:
        """Raises ModelNotFound unless some variant of `name`'s model is on disk: without --pull,
        a request never starts a download."""
        from localinfer.errors import ModelNotFound
        from localinfer.models import refs
        named = pipeline.name(name, replace(self.fit, offline=True), self.report)
        ref = named.ref
        if ref.path is not None:
            return
        quants = [ref.quant] if named.chosen else list(ref.spec.variants)
        store = refs.model_store()
        if not any(store.find(ref.spec.name, quant) for quant in quants):
            raise ModelNotFound(f"{ref.spec.display_name} is not on disk (`localinfer pull "
                                f"{name[:200]}` first, or serve --pull)")

    def plan(self, name: str) -> Plan:
        """The fit of `name` (a pool key), its file pulled or a variant quantized only as
        `fit` allows (offline, quantize_to_fit); TooLarge when no variant fits the budget."""
        named = pipeline.name(name, self.fit, self.report)

        def fit(options: FitOptions) -> pipeline.BatchFit:
            try:
                return pipeline.fit_batch(named, options, self.report, parallel=self.parallel,
                                          shared=True, threads=self.threads,
                                          engine_log=self.engine_log, backend=self.backend)
            except DoesNotFit as e:     # a 400 naming the --memory it needs, as the pool's own
                raise TooLarge(str(e)) from None
        fitted = fit(self.fit)
        mmproj = projector_for(fitted, self.report)
        if mmproj:                  # fitted again with it counted, as `run` fits with --mmproj
            fitted = fit(replace(self.fit, mmproj=mmproj))
        need, where = need_of(fitted)
        return Plan(need, fitted.options.n_ctx, (named, fitted), where)

    def load(self, name: str, plan: Plan) -> ServedModel:
        from localinfer.cache import prompt_cache
        named, fitted = plan.detail
        batch = fitted.load()
        try:
            worker = Worker(batch, self.parallel + self.queue,
                            prompt_cache.open_for(batch.session, enabled=self.use_cache),
                            batch.n_ctx)
        except BaseException:
            batch.close()
            raise
        # opened on the first embeddings request, as `localinfer embed` opens it (its --ctx 0)
        embeddings = Embeddings(pinned(named, fitted.ref), replace(self.fit, ctx=0),
                                threads=self.threads, engine_log=self.engine_log,
                                backend=self.backend, log=self.log)
        return ServedModel(name, fitted.ref, batch, worker, fitted.path, plan.need,
                           names_of(name, fitted.ref), embeddings)


def projector_for(fitted: pipeline.BatchFit, report: Reporter) -> str:
    """The projector file a served model loads ("" for none): the one `run` and `chat` find
    beside the located model file (engine/media.load_projector), on llama.cpp only."""
    from localinfer.engine.media import MAYBE, load_projector
    if fitted.backend.name != "llama.cpp":
        return ""
    found = load_projector(MAYBE, fitted.path, fitted.ref.display, "llama.cpp")
    if found:
        from localinfer.backends.llama.mtmd import capabilities
        from localinfer.errors import UsageError
        try:
            capabilities(Path(found))
        except UsageError as e:     # a stray file must not stop the model's text
            report.notify(f"{e}: {fitted.ref.display} is served without images or audio")
            return ""
    return found


def names_of(name: str, ref: ModelRef) -> tuple[str, ...]:
    """What a request may call a loaded model: names[0] is the one listed and answered with."""
    spec = getattr(ref, "spec", None)
    aliases = [spec.name, *spec.aliases] if spec else []
    return tuple(dict.fromkeys([ref.display, name, *aliases]))


def need_of(fitted: pipeline.BatchFit) -> tuple[Need, str]:
    """What a fitted batch holds once loaded, from the estimate `run` and `info` use (within a
    few percent of peak RSS), less the runtime's share (`pooled`'s overhead); and where it runs.
    A batch writes a row of logits for each of its sequences in one decode."""
    from localinfer.fit.projector import projector_bytes
    facts = memory.with_extra_weights(memory.facts_from_file(fitted.path),
                                      projector_bytes(fitted.options.mmproj))
    machine = rules.detect_machine()
    request = memory.Request(context_length(fitted.options.n_ctx, facts.context_length),
                             kv_type=fitted.options.kv_type, logits_rows=fitted.n_seq,
                             repack=machine.repacks)
    where = rules.footprint(facts, request, machine, gpu_layers=fitted.options.gpu_layers,
                            cpu_moe=fitted.options.cpu_moe)
    if machine.metal_working_set is not None:       # one memory: the GPU's share is RAM
        return Need(where.needed - memory.RUNTIME_BASE), "100% GPU" if where.on_gpu else ""
    return Need(where.needed - memory.RUNTIME_BASE, where.on_gpu), ""


def _return_heap() -> None:
    """Give the allocator's free pages back to the system: glibc keeps freed heap memory for
    reuse, and an unloaded model's memory should show as free to the next one and to `ps`."""
    if not sys.platform.startswith("linux"):
        return
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):   # not glibc (musl has no malloc_trim)
            pass
