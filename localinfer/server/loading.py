"""The model pool's real plan and load (server/pool.py): a name fitted as `serve` fits its model,
its memory need from the fit's estimate, and the model loaded as a batch under its own scheduler.

Every model is fitted against the pool's whole budget (as if alone: the pool makes the room), so
the budget is fixed once, when the pool is made (`pooled`): the RAM free later is less by what
the pool itself holds, and a fit that read it again would shrink or refuse the next model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass, replace

from localinfer.backends import BatchSession, context_length
from localinfer.fit import auto, memory, rules
from localinfer.fit.options import FitOptions, Reporter
from localinfer.models.refs import ModelRef
from localinfer.pipeline import load as pipeline
from localinfer.server.pool_state import Need, Plan
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
    """One loaded model: its batch session and the worker that runs its requests."""

    name: str
    ref: ModelRef
    batch: BatchSession
    worker: Worker

    @property
    def n_ctx(self) -> int:
        return self.batch.n_ctx

    def close(self) -> None:
        """The worker ends (the pool unloads only models no request holds), then the model."""
        self.worker.stop()
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

    def key(self, name: str) -> str:
        """The name the pool holds a model under, the same for every name of one model (an
        alias, another case): with its variant when the name picks one (NAME:QUANT, a file),
        else the model's own (the fit picks the variant). `plan` takes it as a name."""
        named = pipeline.name(name, self.fit, self.report)
        if named.ref.path is not None:
            return str(named.ref.path.resolve())
        return named.ref.display if named.chosen else named.ref.spec.display_name

    def plan(self, name: str) -> Plan:
        named = pipeline.name(name, self.fit, self.report)
        fitted = pipeline.fit_batch(named, self.fit, self.report, parallel=self.parallel,
                                    shared=True, threads=self.threads, engine_log=self.engine_log,
                                    backend=self.backend)
        need, where = need_of(fitted)
        return Plan(need, fitted.options.n_ctx, fitted, where)

    def load(self, name: str, plan: Plan) -> ServedModel:
        from localinfer.cache import prompt_cache
        fitted: pipeline.BatchFit = plan.detail
        batch = fitted.load()
        try:
            worker = Worker(batch, self.parallel + self.queue,
                            prompt_cache.open_for(batch.session, enabled=self.use_cache),
                            batch.n_ctx)
        except BaseException:
            batch.close()
            raise
        return ServedModel(name, fitted.ref, batch, worker)


def need_of(fitted: pipeline.BatchFit) -> tuple[Need, str]:
    """What a fitted batch holds once loaded, from the estimate `run` and `info` use (within a
    few percent of peak RSS), less the runtime's share (`pooled`'s overhead); and where it runs.
    A batch writes a row of logits for each of its sequences in one decode."""
    facts = memory.facts_from_file(fitted.path)
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
