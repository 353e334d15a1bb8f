"""From a model reference to a loaded Session, and from text to prompt tokens.

This is the request path of DESIGN.md up to the decode loop:
catalogue.resolve → fetch.ensure → backends.select → load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from localinfer import backends, settings
from localinfer.backends import LoadOptions, Session
from localinfer.errors import ModelLoadError, ModelNotFound, UsageError
from localinfer.models import catalogue, fetch
from localinfer.models.catalogue import ModelSpec
from localinfer.models.gguf_header import read_header
from localinfer.models.store import Store


@dataclass(frozen=True)
class ModelRef:
    """What a user named: a catalogue entry and quant, or a file on disk."""

    display: str
    spec: ModelSpec | None
    quant: str | None
    path: Path | None               # set for a file reference


def looks_like_path(ref: str) -> bool:
    return ref.lower().endswith(".gguf") or "/" in ref or ref.startswith(".")


def parse_ref(ref: str, cat: catalogue.Catalogue | None) -> ModelRef:
    """What `ref` names; `cat` may be None when `ref` is a path (see `looks_like_path`)."""
    if not ref.strip():
        raise UsageError("the model name is empty")
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


def locate(ref: ModelRef, store: Store, *, offline: bool, progress: bool,
           notify: fetch.Notify) -> Path:
    """The file to load, pulling a catalogue model that is not on disk yet."""
    if ref.path is not None:
        return ref.path
    assert ref.spec is not None
    return fetch.ensure(ref.spec, ref.spec.variant(ref.quant), store, offline=offline,
                        progress=progress, notify=notify)


@dataclass
class LoadedModel:
    ref: ModelRef
    path: Path
    session: Session
    backend: str
    backend_reason: str
    load_s: float


def load(ref: ModelRef, path: Path, *, backend: str, options: LoadOptions) -> LoadedModel:
    arch = str(read_header(path).metadata.get("general.architecture", "")) or None
    chosen, choice = backends.select(backend, arch)
    start = time.perf_counter()
    session = chosen.load(path, options)
    return LoadedModel(ref, path, session, choice.backend, choice.reason,
                       time.perf_counter() - start)


def uses_chat_template(session: Session, raw: bool) -> bool:
    return not raw and bool(session.chat_template)


def chat_tokens(session: Session, messages: list[dict[str, str]]) -> list[int]:
    """Render the model's own chat template and tokenize it, special tokens included."""
    from localinfer.engine import templates  # jinja2: only for chat models, not for every command
    if not session.chat_template:
        raise ModelLoadError("this model has no chat template; use --raw")
    text = templates.render(session.chat_template, messages,
                            bos_token=_text(session, session.bos_token),
                            eos_token=_text(session, session.eos_token))
    return with_bos(session, session.tokenize(text, special=True))


def raw_tokens(session: Session, text: str) -> list[int]:
    return with_bos(session, session.tokenize(text, special=True))


def with_bos(session: Session, tokens: list[int]) -> list[int]:
    # Templates usually write BOS themselves; add it only when the model wants it and it is missing.
    if session.add_bos and session.bos_token is not None and tokens[:1] != [session.bos_token]:
        return [session.bos_token, *tokens]
    return tokens


def _text(session: Session, token: int | None) -> str:
    return session.token_text(token) if token is not None else ""
