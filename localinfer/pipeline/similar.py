"""`--reuse-similarity`: where `run`'s request stands among the stored prompts that differ from
it in the user's text alone (cache/semantic.py keeps them; pipeline/reuse.py asks and records).

The prompt's text (as `--reuse-answers` normalises it) is embedded by the embedding model the
request names, or by the model that answers it, loaded a second time in embedding mode: one
vector per request, the model closed at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from localinfer.cache import semantic


@dataclass(frozen=True)
class Similar:
    """What a request asks of matching by meaning: the least cosine similarity that counts as
    the same prompt, and the embedding model ("": the model that answers)."""

    threshold: float
    embedder: str = ""


def asked(threshold: float | None, embedder: str | None, *,
          option: str = "--reuse-embedder") -> Similar | None:
    """What `--reuse-similarity` and `--reuse-embedder` (the Python API's reuse_similarity and
    reuse_embedder) ask for, checked: None without a threshold, whatever the embedder (a config
    file may name one for the runs that give a threshold). A missing embedder file is refused
    here, before the answering model loads (a name is checked as it loads)."""
    from localinfer.errors import UsageError
    from localinfer.models.refs import looks_like_path
    if threshold is None:
        return None
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not 0 <= threshold <= 1:
        raise UsageError(f"the similarity threshold is a cosine from 0 to 1, not {threshold!r}")
    if embedder is not None and not isinstance(embedder, str):
        raise UsageError("the embedding model is named by a string")
    if embedder and looks_like_path(embedder) and not Path(embedder).expanduser().is_file():
        raise UsageError(f"{option}: no such model file: {embedder}")
    return Similar(float(threshold), embedder or "")


@dataclass(frozen=True)
class Probe:
    """One request's place among similar prompts: the index of its context, its vector, its
    text."""

    index: semantic.SemanticIndex
    vector: np.ndarray
    prompt: str


def probe_for(session, slot, prompt, similar: Similar, *, offline: bool = False,
              notify: Callable[[str], None] = lambda line: None) -> Probe | None:
    """The probe of `run`'s request (`prompt`: its engine.prompt.PromptText, normalised; `slot`:
    its exact place, pipeline.reuse.Slot); None when its text cannot be embedded whole (longer
    than the embedder's context: a cut text would match whatever shares its start) or when it
    holds images or sounds (the text's embedding does not see them)."""
    from localinfer.engine.prompt import prompt_tokens
    from localinfer.errors import UsageError
    from localinfer.pipeline import embed
    if not prompt.text or getattr(prompt, "media", ()):
        return None
    name = similar.embedder or str(session.state_identity().get("model", ""))
    if not name:
        return None
    context_tokens = prompt_tokens(session, replace(prompt, text=semantic.PLACEHOLDER))
    with embed.load(name, batch=1, offline=offline) as embedder:
        try:
            vector = embed.vectors(embedder, prompt.text)[0]
        except UsageError:
            return None
        identity = semantic.embedder_identity(Path(embedder.path), embedder.dimensions)
        dimensions = embedder.dimensions
    store = slot.store
    context = semantic.context_key(store.model_key, slot.settings, context_tokens, identity)
    index = semantic.SemanticIndex(store.root, context, dimensions=dimensions,
                                   label=f"{store.label} (similarity index)", notify=notify)
    return Probe(index, vector, prompt.text)


def find(probe: Probe, store, threshold: float):
    """(match, stored answer) of the closest stored prompt at or over `threshold`, or
    (None, None). An index entry whose answer the store no longer has is dropped."""
    match = probe.index.find(probe.vector, threshold)
    if match is None:
        return None, None
    answer = store.lookup(match.key)
    if answer is None:
        probe.index.drop(match.key)
        return None, None
    return match, answer
