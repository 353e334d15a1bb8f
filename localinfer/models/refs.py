"""What a user named — a catalogue entry and quant, a Hub repository (`hf:`), or a file — and
where its file is.

The first steps of the request path (docs/architecture.md): a name is parsed once into a
`ModelRef`, `locate` finds its file (pulling it when needed), then `engine.load` loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localinfer import settings
from localinfer.errors import ModelNotFound, UsageError
from localinfer.models import catalogue, fetch, hub
from localinfer.models.catalogue import ModelSpec
from localinfer.models.store import Store


@dataclass(frozen=True)
class ModelRef:
    """What a user named: a catalogue entry and quant, or a file on disk."""

    display: str
    spec: ModelSpec | None
    quant: str | None
    path: Path | None               # set for a file reference


@dataclass(frozen=True)
class Named:
    """A model as the user named it (with --quant applied), parsed once: the text, and what it
    names. `chosen`: the name picks one variant (NAME:QUANT, an hf: file, a path), else the fit
    picks among the model's variants."""

    text: str
    ref: ModelRef

    @property
    def chosen(self) -> bool:
        return self.ref.path is not None or names_quant(self.text)


def name(model: str, quant: str, *, offline: bool = False,
         notify: fetch.Notify = lambda _: None) -> Named:
    """`model` with `quant` (a --quant value; auto leaves the choice to the fit), parsed."""
    text = with_quant(model, quant)
    cat = None if looks_like_path(text) else context()[1]
    return Named(text, parse_ref(text, cat, offline=offline, notify=notify))


def looks_like_path(ref: str) -> bool:
    if hub.is_hub_ref(ref):
        return False
    return ref.lower().endswith(".gguf") or "/" in ref or ref.startswith(".")


def names_quant(ref: str) -> bool:
    """Whether `ref` names one variant (NAME:QUANT, hf:OWNER/REPO:QUANT or .../FILE.gguf)."""
    if hub.is_hub_ref(ref):
        return hub.parse(ref).names_variant
    return ":" in ref


def with_quant(ref: str, quant: str) -> str:
    """`ref` naming `quant` (a --quant option), unless it names a variant or file already."""
    if quant.lower() == "auto" or names_quant(ref) or looks_like_path(ref):
        return ref
    return f"{ref}:{quant}"


def parse_ref(ref: str, cat: catalogue.Catalogue | None, *, offline: bool = False,
              notify: fetch.Notify = lambda _: None) -> ModelRef:
    """What `ref` names; `cat` may be None when `ref` is a path (see `looks_like_path`). An `hf:`
    reference takes its repository's listing from the store, else from the Hub (not `offline`)."""
    if not ref.strip():
        raise UsageError("the model name is empty")
    if hub.is_hub_ref(ref):
        store = model_store()
        spec, quant = hub.resolve(ref, store, offline=offline, notify=notify)
        return variant_ref(spec, quant, store)
    if looks_like_path(ref):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise ModelNotFound(f"no such model file: {ref}")
        return ModelRef(display=path.name, spec=None, quant=None, path=path)
    try:
        spec, quant = cat.resolve(ref)
    except UsageError:
        made = _made_locally(ref, cat)   # e.g. `localinfer quantize` output the catalogue lacks
        if made is None:
            raise
        return made
    return ModelRef(display=f"{spec.name}:{quant}", spec=spec, quant=quant, path=None)


def _made_locally(ref: str, cat: catalogue.Catalogue) -> ModelRef | None:
    """NAME:QUANT found in the store though the catalogue does not list it (a local quantization)."""
    name, _, quant = ref.partition(":")
    spec = cat.get(name)
    stored_name = spec.name if spec else name.strip().lower()
    quant = catalogue.normalise_quant(quant) if quant else ""
    path = Store(settings.load().models_dir).find(stored_name, quant) if quant else None
    if path is None:
        return None
    return ModelRef(display=f"{stored_name}:{quant}", spec=spec, quant=quant, path=path)


def context() -> tuple[settings.Settings, catalogue.Catalogue, Store]:
    conf = settings.load()
    return conf, catalogue.load(conf.user_catalogue), Store(conf.models_dir)


def model_store() -> Store:
    """The store alone, for callers that need no catalogue (reading it costs a file parse)."""
    return Store(settings.load().models_dir)


def locate(ref: ModelRef, store: Store, *, offline: bool, progress: bool,
           notify: fetch.Notify, download_bar: fetch.DownloadBar | None = None) -> Path:
    """The file to load, pulling a catalogue model that is not on disk yet (see fetch.ensure)."""
    if ref.path is not None:
        return ref.path
    assert ref.spec is not None
    return fetch.ensure(ref.spec, ref.spec.variant(ref.quant), store, offline=offline,
                        progress=progress, notify=notify, download_bar=download_bar)


def variant_ref(spec: ModelSpec, quant: str, store: Store) -> ModelRef:
    """One quant of a catalogue model: one the catalogue lists, or one made here (in the store)."""
    path = None if quant in spec.variants else store.find(spec.name, quant)
    return ModelRef(display=f"{spec.display_name}:{quant}", spec=spec, quant=quant, path=path)
