"""`run --quant auto`: from a model name and a memory budget to the variant, context and KV type.

The most precise variant that fits wins: one on disk, else one a source offers, else one made here
by quantizing the most precise variant on disk (kept in the store as NAME:TYPE, so the next run
finds it on disk). Every decision about what fits is left to the pure functions in `fit`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from localinfer import settings
from localinfer.backends import context_length
from localinfer.errors import DoesNotFit, LocalinferError, UsageError
from localinfer.fit import memory, rules
from localinfer.fit.projector import planned_bytes, projector_bytes
from localinfer.fit.options import FitOptions, Notify, QuantizeBar, Reporter
from localinfer.models import refs
from localinfer.units import parse_size

# RoPE scalings llama.cpp applies when asked (--rope-scaling), and how many times the trained
# context they may stretch it: past a few times even YaRN's answers fall apart.
ROPE_SCALINGS = ("yarn", "linear")
MAX_STRETCH = 8
# What auto-fit may quantize to, best quality first: the K-quant mixes llama.cpp recommends, none
# of which needs an importance matrix. Legacy and IQ types add little between these steps.
AUTO_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q3_K_L", "Q3_K_M",
              "Q3_K_S", "Q2_K")


@dataclass(frozen=True)
class Resolved:
    ref: refs.ModelRef        # what to open
    n_ctx: int                # 0 keeps the backend's default
    kv_type: str
    notes: tuple[str, ...]
    gpu_layers: int = -1      # layers on the GPU (LoadOptions.gpu_layers); -1: not placed, all
    cpu_moe: int = 0          # layers whose experts stay in host memory (LoadOptions.cpu_moe)
    trained: int = 0          # the model's trained context (0: not known before its pull)


@dataclass(frozen=True)
class Fitting:
    """The budget and the request every candidate is placed against."""

    machine: rules.Machine
    budget: rules.Budget
    n_ctx: int
    kv_type: str | None
    gpu_layers: int | None = None     # --gpu-layers; None: as many as the GPU holds
    min_ctx: int = rules.MIN_CTX      # the shortest context the request allows (its prompt)
    cpu_moe: int | None = None        # --cpu-moe; None: as few as make the rest fit the GPU
    projector: int = 0                # bytes a multimodal projector adds (fit/projector.py)

    def place(self, facts: memory.ModelFacts) -> rules.Placement:
        facts = memory.with_extra_weights(facts, self.projector)
        return rules.place(facts, self.machine, self.budget, n_ctx=_ctx(facts, self.n_ctx),
                           kv_type=self.kv_type, gpu_layers=self.gpu_layers, min_ctx=self.min_ctx,
                           cpu_moe=self.cpu_moe)

    def choose(self, candidates: list[rules.Candidate], n_ctx: int):
        candidates = [replace(c, facts=memory.with_extra_weights(c.facts, self.projector))
                      for c in candidates]
        return rules.choose_variant(candidates, self.machine, self.budget, n_ctx=n_ctx,
                                    kv_type=self.kv_type, gpu_layers=self.gpu_layers,
                                    min_ctx=self.min_ctx, cpu_moe=self.cpu_moe)

    def refusal(self, name: str, facts: memory.ModelFacts, smaller: str | None) -> str:
        facts = memory.with_extra_weights(facts, self.projector)
        return rules.does_not_fit(name, facts, self.machine, self.budget, kv_type=self.kv_type,
                                  smaller_quant=smaller, gpu_layers=self.gpu_layers,
                                  cpu_moe=self.cpu_moe)


def resolve(named: refs.Named, fit: FitOptions, report: Reporter = Reporter(), *,
            n_ctx: int | None = None, min_ctx: int = rules.MIN_CTX) -> Resolved:
    """Pick (pulling or quantizing if need be) what to load so that it fits; a LocalinferError
    naming the shortfall and what would make it fit when nothing does. The context is `n_ctx`
    (default: fit.ctx), and may be shortened to fit down to `min_ctx` (fit.request passes the
    prompt's length). `report` hears the notes and draws the pull's and quantization's bars."""
    n_ctx = fit.ctx if n_ctx is None else n_ctx
    check_kv_type(fit.kv_type)
    store = refs.model_store()
    ref = named.ref
    mmproj = getattr(fit, "mmproj", "")
    fitting = Fitting(*machine_and_budget(fit.memory), n_ctx, fit.kv_type, fit.gpu_layers,
                      min_ctx, fit.cpu_moe, _projector(mmproj, ref, store, remote=not fit.offline))
    if named.chosen:
        path = ref.path or store.find(ref.spec.name, ref.quant)
        if path is None:          # to be pulled: nothing to measure yet
            return Resolved(ref, n_ctx, fit.kv_type or "f16", (), _as_asked(fit.gpu_layers),
                            fit.cpu_moe or 0)
        smaller = ("`localinfer quantize`" if ref.path else
                   f"`{ref.spec.display_name}` with --quant auto picks or makes one")
        return _fixed(ref, memory.facts_from_file(path), fitting, smaller)
    if not any(m.name == ref.spec.name for m in store.installed()):
        # Nothing on disk to read the model's facts from: pull the variant that fits by the facts
        # of a Hub file's header (read remotely), else the default variant; then fit.
        if ref.spec.hub_repo and not fit.offline:
            ref = _first_from_hub(ref, store, fitting)
        refs.locate(ref, store, offline=fit.offline, progress=report.progress,
                    notify=report.notify, download_bar=report.download_bar)
        # The projector came with it: its own header now, not the size it was planned by.
        fitting = replace(fitting, projector=_projector(mmproj, ref, store, remote=False))
    return _best_variant(ref.spec, store, fitting, notify=report.notify,
                         quantize_bar=report.quantize_bar, quantize=fit.quantize_to_fit,
                         pullable=not fit.offline)


def check_trained(ctx: int, trained: int, name: str, rope_scaling: str = "") -> None:
    """Refuse a context of `ctx` tokens (0: the default, always within) beyond the model's
    `trained` one (0: unknown): RoPE positions past it are ones the model never saw, and its
    answers fall apart there. Only an explicit RoPE scaling (`rope_scaling`, serve's
    --rope-scaling) stretches it, up to MAX_STRETCH times, and only to a context beyond it."""
    if rope_scaling:
        check_rope_scaling(rope_scaling)
    if not ctx or not trained:
        return
    if not rope_scaling:
        if ctx > trained:
            raise UsageError(f"--ctx {ctx} is beyond {name}'s trained context of {trained:,} "
                             f"tokens (its answers fall apart past it); give --ctx {trained} or "
                             "less (0: as much as fits), or stretch it explicitly with serve's "
                             "--rope-scaling yarn")
        return
    if ctx <= trained:
        raise UsageError(f"--rope-scaling stretches {name}'s trained context ({trained:,} "
                         f"tokens) to a longer --ctx; give --ctx above {trained}, or leave "
                         "--rope-scaling out")
    if ctx > MAX_STRETCH * trained:
        raise UsageError(f"--ctx {ctx} is more than {MAX_STRETCH} times {name}'s trained context "
                         f"({trained:,} tokens), further than RoPE scaling holds; give --ctx "
                         f"{MAX_STRETCH * trained} or less")


def check_rope_scaling(rope_scaling: str) -> None:
    if rope_scaling not in ROPE_SCALINGS:
        raise UsageError(f"unknown --rope-scaling '{rope_scaling[:40]}'; choose "
                         f"{' or '.join(ROPE_SCALINGS)}")


def check_kv_type(kv_type: str | None) -> None:
    if kv_type is not None and kv_type not in memory.KV_TYPE_BYTES:
        raise UsageError(f"unknown KV-cache type '{kv_type}'; choose f16, q8_0 or q4_0")


def first_pull(ref: refs.ModelRef, store, *, n_ctx: int = 0, kv_type: str | None = None,
               memory_budget: str | None = None, gpu_layers: int | None = None,
               cpu_moe: int | None = None) -> refs.ModelRef:
    """The variant of a model with nothing on disk to pull first: for a Hub model the one that
    fits by its header read remotely (see `_first_from_hub`), else `ref` (its default)."""
    if ref.spec is None or not ref.spec.hub_repo:
        return ref
    fitting = Fitting(*machine_and_budget(memory_budget), n_ctx, kv_type, gpu_layers,
                      cpu_moe=cpu_moe)
    return _first_from_hub(ref, store, fitting)


def _first_from_hub(ref: refs.ModelRef, store, fitting: Fitting) -> refs.ModelRef:
    """The most precise listed quant that fits, judged by the default quant's header (a few MB
    read from the Hub) scaled to each file's size; `ref` itself when none fits or the header
    cannot be read (the pull then says why, or quantize-to-fit starts from the default)."""
    from localinfer.models import hub
    spec = ref.spec
    try:
        header, size = hub.remote_header(spec, spec.default_quant)
    except LocalinferError:
        return ref
    base = memory.facts_from_header(header, size)
    candidates = [rules.Candidate(q, _scaled(base, v.size), False)
                  for q, v in spec.variants.items() if v.size]
    choice = fitting.choose(candidates, _ctx(base, fitting.n_ctx))
    return refs.variant_ref(spec, choice[0].quant, store) if choice else ref


def _scaled(base: memory.ModelFacts, size: int) -> memory.ModelFacts:
    """A variant's facts from another variant's: the same model, its weights `size` bytes."""
    return memory.with_quant_size(base, size, int(base.repackable_bytes * size / base.file_size))


def machine_and_budget(memory_budget: str | None) -> tuple[rules.Machine, rules.Budget]:
    """This machine and the budget a fit places against: --memory's (`memory_budget`), else
    LOCALINFER_MEMORY_BUDGET, else what the machine has free now less headroom."""
    machine = rules.detect_machine()
    if memory_budget:
        return machine, rules.budget(machine, parse_size(memory_budget, "--memory"))
    override = settings.load().memory_budget
    if override:
        return machine, rules.budget(machine, parse_size(override, "LOCALINFER_MEMORY_BUDGET"))
    return machine, rules.budget(machine)


def _projector(mmproj: str, ref: refs.ModelRef, store, *, remote: bool = False) -> int:
    """Bytes the projector to be loaded adds: --mmproj's file, or (a mode that finds it at load,
    engine/media.py) the one beside the model's file or in the store beside its quants; a
    catalogue or Hub model's not pulled yet by its recorded or listed size (and, `remote`, its
    encoder's compute from its header on the Hub), so the quant an hf: model's auto-fit pulls
    is one that fits beside it."""
    if not mmproj:
        return 0
    if Path(mmproj).is_file():
        return projector_bytes(mmproj)
    if ref.path is not None:
        from localinfer.models.projector import beside
        found = beside(ref.path)
        return projector_bytes(found) if found is not None else 0
    if ref.spec is None:
        return 0
    from localinfer.models.store import PROJECTOR
    found = store.path_for(ref.spec.name, PROJECTOR)
    if found.is_file():
        return projector_bytes(found)
    return planned_bytes(ref.spec.projector, remote=remote)


def _fixed(ref: refs.ModelRef, facts: memory.ModelFacts, fitting: Fitting,
           smaller: str) -> Resolved:
    placement = fitting.place(facts)
    if not placement.fits:
        raise DoesNotFit(fitting.refusal(
            ref.display if ref.path is None else str(ref.path), facts, smaller))
    return Resolved(ref, placement.n_ctx, placement.kv_type, placement.notes, placement.gpu_layers,
                    placement.cpu_moe, facts.context_length)


def _best_variant(spec, store, fitting: Fitting, *, notify: Notify,
                  quantize_bar: QuantizeBar, quantize: bool = True,
                  pullable: bool = True) -> Resolved:
    on_disk = {m.quant: m.path for m in store.installed() if m.name == spec.name}
    candidates = [rules.Candidate(q, memory.facts_from_file(p), True) for q, p in on_disk.items()]
    base = candidates[0].facts
    # Offline (run --offline, serve without --pull) only what is on disk can be chosen: a more
    # precise variant that would have to be pulled is no candidate, not a failed download.
    for quant, variant in spec.variants.items() if pullable else ():
        if quant not in on_disk and variant.size:   # pullable, with a known size to reason about
            candidates.append(rules.Candidate(quant, _scaled(base, variant.size), False))
    choice = fitting.choose(candidates, _ctx(base, fitting.n_ctx))
    if choice is not None:
        quant, placement = choice[0].quant, choice[1]
    else:
        smallest = min((c for c in candidates if c.on_disk), key=lambda c: c.facts.file_size)
        if not quantize:            # nothing is written: the refusal names what would fit
            raise DoesNotFit(fitting.refusal(
                f"{spec.display_name} (smallest on disk: {smallest.quant})", smallest.facts,
                f"`localinfer quantize {spec.display_name} --type auto`"))
        quant, placement = _quantize_to_fit(spec.name, on_disk, fitting, smallest,
                                            shown=spec.display_name,
                                            notify=notify, quantize_bar=quantize_bar)
    notes = placement.notes
    if quant != spec.default_quant:
        notes = (f"using {spec.display_name}:{quant}, the most precise variant that fits", *notes)
    return Resolved(refs.variant_ref(spec, quant, store), placement.n_ctx, placement.kv_type,
                    notes, placement.gpu_layers, placement.cpu_moe, base.context_length)


def _ctx(facts: memory.ModelFacts, n_ctx: int) -> int:
    return context_length(n_ctx, facts.context_length)


def _as_asked(gpu_layers: int | None) -> int:
    return -1 if gpu_layers is None else gpu_layers


def place_file(path: Path, *, n_ctx: int, kv_type: str | None = None,
               gpu_layers: int | None = None, memory_budget: str | None = None,
               min_ctx: int = rules.MIN_CTX, cpu_moe: int | None = None) -> rules.Placement:
    """Where a model file's layers go on this machine, for commands that load it as named (and
    for a chat whose context grows)."""
    fitting = Fitting(*machine_and_budget(memory_budget), n_ctx, kv_type, gpu_layers, min_ctx,
                      cpu_moe)
    return fitting.place(memory.facts_from_file(path))


def longest_context(path: Path, *, trained: int, least: int, fit: FitOptions) -> rules.Placement | None:
    """`serve`'s default context on the model file `path`: the `trained` one where the budget
    holds it, else the longest in whole KV pages that it holds, above `least` (the context
    already fitted); None when none above it fits. Halving alone would leave a model trained
    for 32k tokens 16k where 24k fit, too few for a coding agent's first request."""
    machine, budget = machine_and_budget(fit.memory)
    facts = memory.facts_from_file(path)

    def at(n_ctx: int) -> rules.Placement:
        return Fitting(machine, budget, n_ctx, fit.kv_type, fit.gpu_layers, n_ctx,
                       fit.cpu_moe).place(facts)
    whole = at(trained)
    if whole.fits:
        return whole
    best, lo, hi = None, least // memory.KV_PAD, (trained - 1) // memory.KV_PAD
    while lo < hi:               # lo pages fit (the context already fitted), hi + 1 do not
        mid = (lo + hi + 1) // 2
        placed = at(mid * memory.KV_PAD)
        lo, hi, best = (mid, hi, placed) if placed.fits else (lo, mid - 1, best)
    if best is None:
        return None
    return replace(best, notes=(*best.notes, f"context shortened from {trained} to "
                                f"{best.n_ctx} tokens to fit the memory budget"))


def _quantize_to_fit(name: str, on_disk: dict[str, Path], fitting: Fitting,
                     smallest: rules.Candidate, *, notify: Notify, quantize_bar: QuantizeBar,
                     shown: str = "") -> tuple[str, rules.Placement]:
    """Quantize the most precise variant on disk into the best type that fits; keep it in the
    store. Plans come from llama.cpp's dry run, so each size is exact before anything is written.
    `shown` names the model in messages (`name` by default; `hf:OWNER/REPO` for a Hub model)."""
    shown = shown or name
    from localinfer.quant import quantize
    source_quant = quantize.best_on_disk(list(on_disk))
    source = on_disk[source_quant]
    facts = memory.facts_from_file(source)
    for qtype in AUTO_TYPES:
        if qtype in on_disk:      # already placed above, and it did not fit
            continue
        plan = quantize.plan(source, qtype)
        if plan.needs_imatrix:
            continue
        planned = memory.planned_facts(facts, plan)
        placement = fitting.place(planned)
        if placement.fits:
            detail = "; requantizing costs a little quality" if plan.requantized_types else ""
            _make(source, name, qtype, quantize_bar=quantize_bar, notify=notify,
                  message=f"quantizing {shown}:{source_quant} to {qtype} to fit the memory budget "
                          f"(once: kept in the store as {shown}:{qtype}{detail})")
            return qtype, placement
        if planned.file_size < smallest.facts.file_size:
            smallest = rules.Candidate(qtype, planned, False)
    raise DoesNotFit(fitting.refusal(f"{shown} (smallest: {smallest.quant})",
                                     smallest.facts, None))


def _make(source: Path, name: str, qtype: str, *, quantize_bar: QuantizeBar, notify: Notify,
          message: str) -> None:
    from localinfer.quant import quantize
    store = refs.model_store()
    with store.lock(name, qtype):           # a second process waits, then finds the file made
        dst = store.path_for(name, qtype)
        if dst.is_file():
            return
        notify(message)
        with quantize_bar() as bar:
            quantize.quantize_file(source, dst, qtype, allow_requantize=True, progress=bar)
