"""From a model's name to a loaded model fitted to the memory budget: `run`'s fit (the context
sized to a prompt), the fixed fit of the other commands, and the batch `map` and `serve` share."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from localinfer.backends import BACKEND_CHOICES, LoadOptions, context_length
from localinfer.errors import UsageError
from localinfer.fit import auto
from localinfer.fit.options import FitOptions, Reporter
from localinfer.models import refs

if TYPE_CHECKING:
    from localinfer.backends import Backend, BatchSession, Session
    from localinfer.engine.load import LoadedModel
    from localinfer.fit.request import Request, Sized


@dataclass(frozen=True)
class Fitted:
    """What the fit chose: the reference to open, how to load it, and (for a request) the prompt
    as it is to be sent, with the sizing it was fitted on."""

    ref: refs.ModelRef
    options: LoadOptions
    sized: Sized | None = None


def check_backend(backend: str) -> None:
    if backend not in BACKEND_CHOICES:   # before a pull, not after downloading the model
        raise UsageError(f"unknown backend '{backend}'; choose one of: {', '.join(BACKEND_CHOICES)}")


def name(model: str, fit: FitOptions, report: Reporter = Reporter()) -> refs.Named:
    """The model's name parsed, once for the whole request (options checked first: a bad one is
    refused before a Hub listing is read)."""
    auto.check_kv_type(fit.kv_type)
    return refs.name(model, fit.quant, offline=fit.offline, notify=report.notify)


def fit_model(named: refs.Named, fit: FitOptions, report: Reporter = Reporter(), *,
              threads: int = 0, engine_log: bool = False, request: Request | None = None,
              vocab: Session | None = None, ctx_each: int | None = None) -> Fitted:
    """The variant, context, KV type and GPU layers that fit the memory budget (pulled or
    quantized if need be; notes to `report`). With `run`'s `request` the context is sized to its
    prompt (fit.request; `vocab`, a loaded model, counts it), and the sizing comes back with the
    prompt as it is to be sent (--truncate may cut it). A context beyond the model's trained one
    is refused unless fit.rope_scaling stretches it (`ctx_each`: what one sequence gets, when
    fit.ctx is that of several)."""
    from localinfer.engine.prompt import is_long
    from localinfer.fit import request as sizing
    if request is None:
        chosen, sized = auto.resolve(named, fit, report), None
    else:
        sized = sizing.resolve(request, named, fit, report, vocab=vocab)
        chosen = sized.resolved
    auto.check_trained(fit.ctx if ctx_each is None else ctx_each, chosen.trained,
                       chosen.ref.display, fit.rope_scaling)
    for note in (*chosen.notes, *(sized.notes if sized else ())):
        report.notify(note)
    options = LoadOptions(n_ctx=chosen.n_ctx, n_threads=threads, verbose=engine_log,
                          kv_type=chosen.kv_type, gpu_layers=chosen.gpu_layers,
                          cpu_moe=chosen.cpu_moe, rope_scaling=fit.rope_scaling,
                          long_prompt=sized is not None and is_long(sized.prompt),
                          mmproj=fit.mmproj)
    return Fitted(chosen.ref, options, sized)


def open_ref(ref: refs.ModelRef, options: LoadOptions, *, backend: str, offline: bool,
             report: Reporter = Reporter(), place: bool = False,
             gpu_layers: int | None = None, cpu_moe: int | None = None) -> LoadedModel:
    """Locate (pull) and load; with `place`, the layers are placed on the GPU as `run` would
    (`gpu_layers`, `cpu_moe`: --gpu-layers, --cpu-moe, None for auto), else `options`'
    placement is kept."""
    from localinfer.engine.load import load_model
    path = refs.locate(ref, refs.model_store(), offline=offline, progress=report.progress,
                       notify=report.notify, download_bar=report.download_bar)
    if place:
        placed = auto.place_file(path, n_ctx=options.n_ctx, kv_type=options.kv_type,
                                 gpu_layers=gpu_layers, cpu_moe=cpu_moe)
        options = replace(options, gpu_layers=placed.gpu_layers, cpu_moe=placed.cpu_moe)
    return load_model(ref, path, backend=backend, options=options)


def open_model(model: str, options: LoadOptions, *, backend: str, offline: bool,
               report: Reporter = Reporter(), place: bool = False,
               gpu_layers: int | None = None, cpu_moe: int | None = None) -> LoadedModel:
    """Load the model a name or path names, as named (no fit: bench, eval), pulling it first if
    need be."""
    check_backend(backend)
    named = refs.name(model, "auto", offline=offline, notify=report.notify)
    return open_ref(named.ref, options, backend=backend, offline=offline, report=report,
                    place=place, gpu_layers=gpu_layers, cpu_moe=cpu_moe)


def open_for(named: refs.Named, request: Request, fit: FitOptions, report: Reporter, *,
             backend: str, threads: int = 0, engine_log: bool = False,
             loaded: LoadedModel | None = None) -> tuple[LoadedModel, LoadOptions, list[int]]:
    """The model loaded with a context sized to the request's prompt, and the prompt's tokens.
    A prompt fitted on a likely bound is counted by the loaded model; in the rare case it needs a
    larger context than it got, the fit is made again with that count and the model loaded
    again. `loaded`, a model already open, is kept when the fit asks for what it already is."""
    from localinfer.engine.prompt import prompt_tokens
    from localinfer.fit.request import holds
    load = dict(threads=threads, engine_log=engine_log)
    fitted = fit_model(named, fit, report, request=request, **load)
    loaded = reuse_or_load(loaded, fitted, backend=backend, offline=fit.offline, report=report)
    tokens = prompt_tokens(loaded.session, fitted.sized.prompt)
    if holds(fitted.sized, len(tokens), ctx=fit.ctx, reply=request.reply):
        return loaded, fitted.options, tokens
    again = fit_model(named, fit, report, request=request, vocab=loaded.session, **load)
    loaded = reuse_or_load(loaded, again, backend=backend, offline=fit.offline, report=report)
    return loaded, again.options, prompt_tokens(loaded.session, again.sized.prompt)


def reuse_or_load(loaded: LoadedModel | None, fitted: Fitted, *, backend: str, offline: bool,
                   report: Reporter) -> LoadedModel:
    if loaded is not None and (loaded.ref, loaded.options) == (fitted.ref, fitted.options):
        return loaded
    if loaded is not None:
        loaded.session.close()
    return open_ref(fitted.ref, fitted.options, backend=backend, offline=offline, report=report)


@dataclass(frozen=True)
class BatchFit:
    """What map's and serve's fit chose: the model file, how to load it, the sequences its
    context holds, and the backend that batches it."""

    ref: refs.ModelRef
    path: Path
    options: LoadOptions
    n_seq: int
    backend: Backend

    def load(self) -> BatchSession:
        return self.backend.load_batch(self.path, self.options, self.n_seq)


def open_batch(named: refs.Named, fit: FitOptions, report: Reporter = Reporter(), *,
               parallel: int, shared: bool = False, threads: int = 0, engine_log: bool = False,
               backend: str = "auto"):
    """(the model reference, a BatchSession of `parallel` request sequences plus the shared
    prefix's), fitted to the memory budget as `run` fits: map's and serve's (see fit_batch)."""
    fitted = fit_batch(named, fit, report, parallel=parallel, shared=shared, threads=threads,
                       engine_log=engine_log, backend=backend)
    return fitted.ref, fitted.load()


def fit_batch(named: refs.Named, fit: FitOptions, report: Reporter = Reporter(), *,
              parallel: int, shared: bool = False, threads: int = 0, engine_log: bool = False,
              backend: str = "auto") -> BatchFit:
    """The fit of a BatchSession of `parallel` request sequences plus the shared prefix's, as
    `run` fits, the file pulled if need be but nothing loaded. `fit.ctx` is each request's
    context (map), or with `shared` the pool they share, any one of them able to use it all
    (serve; 0: the model's trained context, as far as the memory budget allows). A `backend`
    that cannot batch is refused before anything is pulled."""
    from localinfer import backends
    from localinfer.fit import memory
    from localinfer.gguf.header import read_header
    check_backend(backend)
    backends.select_batch(backend, None)
    ctx = fit.ctx
    fitted = fit_model(named, replace(fit, ctx=ctx if shared else ctx * parallel), report,
                       threads=threads, engine_log=engine_log, ctx_each=ctx)
    options = fitted.options
    path = refs.locate(fitted.ref, refs.model_store(), offline=fit.offline,
                       progress=report.progress, notify=report.notify,
                       download_bar=report.download_bar)
    if shared and not ctx:      # the fit above is run's default context; grow it to the trained one
        trained = memory.facts_from_file(path).context_length
        fitted_ctx = options.n_ctx or context_length(0, trained)
        if trained > fitted_ctx:
            placed = auto.longest_context(path, trained=trained, least=fitted_ctx, fit=fit)
            if placed is not None:
                for note in placed.notes:
                    report.notify(note)
                options = replace(options, n_ctx=placed.n_ctx, kv_type=placed.kv_type,
                                  gpu_layers=placed.gpu_layers, cpu_moe=placed.cpu_moe)
    architecture = str(read_header(path).metadata.get("general.architecture", "")) or None
    chosen, _ = backends.select_batch(backend, architecture, path)
    return BatchFit(fitted.ref, path, options, parallel + 1, chosen)
