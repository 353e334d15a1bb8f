"""From `--draft MODEL|auto|lookup|self|none` to a drafter, and from a drafter to a speculative
generation (plain decoding, without a drafter, is `engine.decode.Generation`)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol, Sequence

from localinfer import settings
from localinfer.backends import Grammar, LoadOptions
from localinfer.engine.decode import Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.load import LoadedModel, load_model
from localinfer.engine.sampling import SamplingParams
from localinfer.errors import LocalinferError
from localinfer.models import refs
from localinfer.gguf.header import read_header
from localinfer.models.store import Store
from localinfer.speculate import exactness
from localinfer.speculate.drafters import Drafter, DraftModel, PromptLookup, check_vocabulary
from localinfer.speculate.verify import SpecStats, SpeculativeGeneration

SELF_DRAFT_QUANT = "Q4_0"       # fast on every CPU backend (repacked kernels) and below 4.5 bits
FALLBACK_SELF_QUANT = "Q2_K"    # when the target itself is Q4_0 already
_Q4_0_FILE_TYPE = 2             # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_0

Notify = Callable[[str], None]


def open_drafter(choice: str, target: LoadedModel, *, options: LoadOptions, offline: bool,
                 notify: Notify) -> Drafter | None:
    """The drafter --draft names; None for `none`. `auto` never fails: lookup is always there."""
    choice = choice.strip()
    if choice == "none":
        return None
    if choice == "lookup":
        return PromptLookup()
    if choice == "auto":
        return _auto(target, options, notify)
    if choice == "self":
        path = self_draft(target, notify=notify)
        return _draft_model(path, f"self ({path.name})", target, options)
    _, cat, store = refs.context()
    ref = refs.parse_ref(choice, cat, offline=offline, notify=notify)
    path = refs.locate(ref, store, offline=offline, progress=False, notify=notify)
    return _draft_model(path, ref.display, target, options)


def _auto(target: LoadedModel, options: LoadOptions, notify: Notify) -> Drafter:
    """The catalogue's draft model when it is on disk, else prompt lookup; never an error."""
    path = _catalogue_draft_on_disk(target)
    if path is None:
        return PromptLookup()
    try:
        return _draft_model(path, path.stem, target, options)
    except LocalinferError as e:       # e.g. a user catalogue naming an incompatible draft
        notify(f"not using draft model {path.name} ({e}); using prompt lookup")
        return PromptLookup()


def _draft_model(path: Path, name: str, target: LoadedModel,
                 options: LoadOptions) -> DraftModel:
    ref = refs.ModelRef(display=name, spec=None, quant=None, path=path)
    # The draft follows the target's sequence, so it needs the target's context length.
    draft_options = LoadOptions(n_ctx=target.session.n_ctx, n_threads=options.n_threads,
                                verbose=options.verbose)
    loaded = load_model(ref, path, backend=target.backend, options=draft_options)
    try:
        check_vocabulary(target.session, loaded.session, name)
    except BaseException:
        loaded.session.close()
        raise
    return DraftModel(loaded.session, name=f"model {name}")


def _catalogue_draft_on_disk(target: LoadedModel) -> Path | None:
    spec = target.ref.spec
    if spec is None or not spec.draft:
        return None
    _, cat, store = refs.context()
    draft = cat.get(spec.draft)
    return store.find(draft.name, draft.default_quant) if draft else None


def self_draft(target: LoadedModel, *, notify: Notify) -> Path:
    """A lower-precision quant of the target, made once with the quantizer and kept in the store."""
    from localinfer.quant import quantize
    conf = settings.load()
    store = Store(conf.models_dir)
    name = target.ref.spec.name if target.ref.spec else quantize.store_name_for(target.path)
    file_type = read_header(target.path).metadata.get("general.file_type")
    quant = FALLBACK_SELF_QUANT if file_type == _Q4_0_FILE_TYPE else SELF_DRAFT_QUANT
    with store.lock(name, quant):
        found = store.find(name, quant)
        if found and found.resolve() != target.path.resolve():
            return found
        dst = store.path_for(name, quant)
        notify(f"making a {quant} draft of {target.ref.display} (once; kept as {dst.name})")
        quantize.quantize_file(target.path, dst, quant, allow_requantize=True,
                               threads=getattr(target.session, "n_threads", 0))
        return dst


def exact_chunk(target: LoadedModel, *, notify: Notify | None = None) -> int:
    """Most tokens one verification eval may carry on this model and engine (cached probe);
    `notify` hears one line before a probe runs (a terminal's note)."""
    conf = settings.load()
    return exactness.exact_batch(target.session, target.path, target.backend,
                                 conf.cache_dir / "exact_batch.json", notify=notify)


class Placed(Protocol):
    """Where a run would put the model (fit.rules.Placement has these)."""
    kv_type: str
    gpu_layers: int
    cpu_moe: int


PROBE_CTX = 512     # holds the probe's longest prefix and the cells it views (exactness.py)


def probe_ahead(path: Path, shown: str, *, place: Callable[[Path], Placed],
                notify: Notify | None, warn: Notify) -> int | None:
    """The exactness probe for a model just pulled or quantized, so its first run does not pay it;
    None, and one `warn` line, where it cannot be made (a model llama.cpp cannot load, no backend
    that decodes it): the model is still there, and a run says what is wrong with it.

    Loaded as a plain `run` of a short prompt loads it: backend auto, default threads, and the KV
    type and GPU layers `place` gives (the fit's, which lives above this layer). A run with other
    options (--kv-type, a long prompt, --threads) has a verdict of its own."""
    try:
        placed = place(path)
        options = LoadOptions(n_ctx=PROBE_CTX, kv_type=placed.kv_type,
                              gpu_layers=placed.gpu_layers, cpu_moe=placed.cpu_moe)
        ref = refs.ModelRef(display=shown, spec=None, quant=None, path=path)
        loaded = load_model(ref, path, backend="auto", options=options)
        try:
            return exact_chunk(loaded, notify=notify)
        finally:
            loaded.session.close()
    except (LocalinferError, OSError, MemoryError) as e:
        warn(f"could not check how {shown} batches for speculative decoding ({e})")
        return None


def speculative(target: LoadedModel, cache: KVCache, prompt: Sequence[int],
                params: SamplingParams, limits: Limits, drafter: Drafter, *,
                max_draft: int, chunk: int | None = None, adaptive: bool = True,
                grammar: Grammar | None = None,
                notify: Notify | None = None) -> SpeculativeGeneration:
    """Speculative decoding with `drafter`, verifying in chunks the exactness probe allows.

    `adaptive=False` drafts `max_draft` tokens every round (tests and benchmarks of the rule itself);
    `notify` hears one line when the probe must run first (see exact_chunk).
    """
    if chunk is None:
        chunk = exact_chunk(target, notify=notify)
        if cache.session.n_past != len(cache.tokens):   # a probe ran and emptied the KV cache
            cache.clear()
    return SpeculativeGeneration(cache, prompt, params, limits, drafter, max_draft=max_draft,
                                 chunk=chunk, adaptive=adaptive, grammar=grammar)


def describe(stats: SpecStats) -> str:
    """The -v line: what was drafted and kept, and the decode speed-up against plain decoding."""
    if stats.drafted == 0:
        return (f"speculation: {stats.drafter} · nothing drafted: the drafter had no guess to "
                "offer, so the decoding was plain (no speed-up to estimate)")
    speedup = f"{stats.speedup:.2f}x vs plain estimate" if stats.speedup else "no plain estimate"
    return (f"speculation: {stats.drafter} · drafted {stats.drafted} · accepted {stats.accepted} "
            f"({stats.acceptance:.0%}) in {stats.rounds} rounds · verify chunk ≤ {stats.chunk} · "
            f"plain step {stats.plain_step_s * 1000:.1f} ms · decode {speedup}")
