"""`run --quant auto`: from a model name and a memory budget to the variant, context and KV type.

Reads the store and the catalogue, then leaves every decision to the pure functions in `fit`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from localinfer import fit, memory, runner, settings
from localinfer.errors import LocalinferError, UsageError

DEFAULT_MAX_CTX = 4096       # as the llama.cpp backend: n_ctx 0 = the model's, up to this


@dataclass(frozen=True)
class Resolved:
    model: str                # what to open: NAME:QUANT or the path as given
    n_ctx: int                # 0 keeps the backend's default
    kv_type: str
    notes: tuple[str, ...]


def resolve(model: str, *, quant: str, n_ctx: int, kv_type: str | None,
            memory_budget: str | None) -> Resolved:
    """Pick what to load so that it fits; a LocalinferError naming the shortfall when nothing does."""
    if kv_type is not None and kv_type not in memory.KV_TYPE_BYTES:
        raise UsageError(f"unknown KV-cache type '{kv_type}'; choose f16, q8_0 or q4_0")
    machine = fit.detect_machine()
    override = memory_budget or settings.load().memory_budget
    budget = fit.budget(machine, fit.parse_size(override) if override else None)
    conf, cat, store = runner.context()
    if quant.lower() != "auto" and ":" not in model and not runner.looks_like_path(model):
        model = f"{model}:{quant}"
    ref = runner.parse_ref(model, cat)
    if ref.path is not None or ":" in model:
        path = ref.path or store.find(ref.spec.name, ref.quant)
        if path is None:          # to be pulled: nothing to measure yet
            return Resolved(model, n_ctx, kv_type or "f16", ())
        return _fixed(model, memory.facts_from_file(path), machine, budget, n_ctx, kv_type)
    return _best_variant(ref.spec, store, machine, budget, n_ctx, kv_type)


def _ctx(facts: memory.ModelFacts, n_ctx: int) -> int:
    return n_ctx or min(facts.context_length or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX)


def _fixed(model: str, facts, machine, budget, n_ctx: int, kv_type: str | None) -> Resolved:
    placement = fit.place(facts, machine, budget, n_ctx=_ctx(facts, n_ctx), kv_type=kv_type)
    if not placement.fits:
        raise LocalinferError(fit.does_not_fit(model, placement.needed, budget))
    return Resolved(model, placement.n_ctx, placement.kv_type, placement.notes)


def _best_variant(spec, store, machine, budget, n_ctx: int, kv_type: str | None) -> Resolved:
    on_disk = {m.quant: m.path for m in store.installed() if m.name == spec.name}
    if not on_disk:       # nothing to measure: the catalogue's default, pulled as usual
        return Resolved(f"{spec.name}:{spec.default_quant}", n_ctx, kv_type or "f16", ())
    candidates = [fit.Candidate(q, memory.facts_from_file(p), True) for q, p in on_disk.items()]
    base = candidates[0].facts
    for quant, variant in spec.variants.items():
        if quant not in on_disk and variant.size:   # pullable, with a known size to reason about
            scaled = replace(base, file_size=variant.size,
                             repackable_bytes=int(base.repackable_bytes * variant.size / base.file_size))
            candidates.append(fit.Candidate(quant, scaled, False))
    choice = fit.choose_variant(candidates, machine, budget, n_ctx=_ctx(base, n_ctx), kv_type=kv_type)
    if choice is None:
        smallest = min(candidates, key=lambda c: c.facts.file_size)
        needed = fit.place(smallest.facts, machine, budget, n_ctx=MIN_CTX_FOR_MESSAGE,
                           kv_type=kv_type).needed
        raise LocalinferError(fit.does_not_fit(f"{spec.name} (smallest: {smallest.quant})",
                                               needed, budget))
    candidate, placement = choice
    notes = placement.notes
    if candidate.quant != spec.default_quant:
        notes = (f"using {spec.name}:{candidate.quant}, the most precise variant that fits", *notes)
    return Resolved(f"{spec.name}:{candidate.quant}", placement.n_ctx, placement.kv_type, notes)


MIN_CTX_FOR_MESSAGE = fit.MIN_CTX
