"""Prefill of a prompt that holds images or audio: text runs and whole media, as llama-mtmd-cli
evaluates its chunks, with prefix reuse and the prompt cache cut only where a cold run cuts.

A medium is a run of placeholder ids in the prompt (backends/llama/mtmd.py), derived from the
hash of its decoded content: a prompt that repeats a picture shares a prefix with the earlier one
up to and through it. The rules here:
- a text run is evaluated from where it starts (or from the reused prefix's end, inside it) in
  batches of n_batch, the last one giving the logits; a medium is decoded whole, never cut;
- a prefix reused from the session never ends inside a medium (it is cut back to its start);
- the prompt cache saves a state at the end of each medium, and restores only there: a cold run
  evaluates the text after a medium from that very position in the same batches, so a restored
  state continues exactly as the cold run (cold == warm, tests/test_multimodal_cache.py). States
  are saved only when every cell before came out of such a run (`canonical_media`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from localinfer.engine.prefix import CacheEvent, common_prefix
from localinfer.errors import ContextOverflow, LocalinferError, UsageError


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    item: object             # the projector's Item


def projector_of(session):
    return getattr(session, "media", None)


def holds_media(session, tokens: Sequence[int]) -> bool:
    """Whether `tokens` holds a medium's placeholders for this session's projector."""
    projector = projector_of(session)
    return projector is not None and len(tokens) > 0 and max(tokens) >= projector.n_vocab


def spans(projector, tokens: Sequence[int]) -> list[Span]:
    """Where the media sit in `tokens` (each one's placeholders checked whole and in order)."""
    found, i, n = [], 0, len(tokens)
    while i < n:
        if tokens[i] >= projector.n_vocab:
            item = projector.item_at(tokens, i)
            found.append(Span(i, i + item.n, item))
            i += item.n
        else:
            i += 1
    return found


def text_only(session, tokens: Sequence[int]) -> list[int]:
    """`tokens` without placeholders: what a sampler's penalties or a drafter may look at."""
    projector = projector_of(session)
    if projector is None:
        return list(tokens)
    return [t for t in tokens if t < projector.n_vocab]


def prefill(cache, prompt: Sequence[int]) -> tuple[np.ndarray, int]:
    """KVCache.prefill for a prompt with media; returns (last logits, positions reused)."""
    session = cache.session
    projector = projector_of(session)
    n = len(prompt)
    if n > session.n_ctx:
        raise ContextOverflow(f"the prompt with its media is {n} tokens but the context holds "
                              f"{session.n_ctx}; raise --ctx or send fewer or smaller media")
    found = spans(projector, prompt)
    if found[-1].end >= n:
        raise UsageError("a prompt cannot end with an image or audio clip: put text after it")
    ends = [s.end for s in found]
    del cache.tokens[session.n_past:]
    reuse = _outside(found, min(common_prefix(cache.tokens, prompt), n - 1))
    canonical = reuse == 0 or (reuse in ends and cache.canonical_media >= reuse)
    if cache.store is not None:
        restored = _restore(cache, prompt, reuse, ends)
        if restored is not None:
            reuse, canonical = restored, True
    if not session.trim(reuse):
        session.reset()
        reuse, canonical = 0, True
    del cache.tokens[reuse:]
    cache._canonical = 0          # these cells are not batched as the text path batches
    logits = _evaluate(cache, prompt, reuse, found, snapshots=canonical and cache.store is not None)
    cache.canonical_media = ends[-1] if canonical else min(cache.canonical_media, reuse)
    projector.forget(cache.tokens)
    return logits, reuse


def _outside(found: list[Span], reuse: int) -> int:
    """`reuse` moved back to the start of the medium it would end inside."""
    for span in found:
        if span.start < reuse < span.end:
            return span.start
    return reuse


def _restore(cache, prompt: Sequence[int], reuse: int, ends: list[int]) -> int | None:
    """The state saved at the furthest medium's end this prompt shares, when it beats `reuse`."""
    store, session = cache.store, cache.session
    found = store.longest_prefix(prompt, limit=ends[-1], longest=session.n_ctx)
    if found is None or found[1] != len(found[0].tokens) or found[1] not in ends \
            or found[1] <= reuse:
        cache.last_event = CacheEvent(False, note="miss")
        return None
    head, start = found[0], time.perf_counter()
    state = store.load(head)
    if state is None:
        cache.last_event = CacheEvent(False, note="corrupt entry dropped")
        return None
    cache.tokens.clear()
    try:
        session.restore(state, len(head.tokens))
    except LocalinferError:
        store.drop(head)
        cache.last_event = CacheEvent(False, note="entry rejected by the engine, dropped")
        session.reset()
        return None
    cache.tokens = list(head.tokens)
    cache.last_event = CacheEvent(True, len(head.tokens), time.perf_counter() - start)
    return len(head.tokens)


def _evaluate(cache, prompt: Sequence[int], start: int, found: list[Span], *,
              snapshots: bool) -> np.ndarray:
    session, projector = cache.session, projector_of(cache.session)
    step = int(getattr(session, "n_batch", 512))
    cache._pending = []
    logits, pos = None, start
    todo = [s for s in found if s.end > start]
    for k, span in enumerate(todo):
        logits = _text(cache, prompt, pos, span.start, step) if span.start > pos else logits
        projector.evaluate(session, span.item, _run(todo, k))
        cache.tokens.extend(prompt[span.start:span.end])
        pos = span.end
        whole = k + 1 == len(todo) or todo[k + 1].item.medium != span.item.medium
        if snapshots and whole:     # at the end of each image or clip, not of each tile
            cache._pending.append((list(prompt[:pos]), session.state()))
    return _text(cache, prompt, pos, len(prompt), step)


def _run(todo: list[Span], k: int) -> list:
    """The media right after todo[k] with no text between (encoded in one batch, as the CLI)."""
    run = []
    for prev, span in zip(todo[k:], todo[k + 1:]):
        if span.start != prev.end:
            break
        run.append(span.item)
    return run


def _text(cache, prompt: Sequence[int], start: int, end: int, step: int) -> np.ndarray | None:
    """prompt[start:end] in batches of `step`; the logits of its last token only when it ends
    the prompt (each output row costs a pass over the output layer: a few ms per medium)."""
    logits, last = None, end == len(prompt)
    for at in range(start, end, step):
        piece = prompt[at:min(at + step, end)]
        logits = cache.session.eval(piece, logits="last" if last else "none")
        cache.tokens.extend(piece)
    assert logits is not None or not last
    return logits


AUTO = "auto"       # LoadOptions.mmproj: the projector beside the model file, found at load
MAYBE = "maybe"     # the same, and none is no error (chat: /image says what is missing)


def find_projector(model: str, mmproj: str | None, given: tuple) -> str:
    """The projector for `given` media ("" when there are none): --mmproj's file, checked for
    the kinds given; else the one beside a local model file (models.projector), or AUTO for a
    catalogue or Hub name, whose projector sits beside its quants once pulled (load_projector).
    A local model without one is refused in one line."""
    if not given:
        return ""
    if not mmproj:
        path = Path(model)
        if not (path.suffix.lower() == ".gguf" and path.is_file()):
            return AUTO
        from localinfer.models.projector import beside
        found = beside(path)
        if found is None:
            raise UsageError(f"{path.name} has no projector (mmproj file) beside it for images "
                             "or audio; name one with --mmproj FILE")
        mmproj = str(found)
    from localinfer.backends.llama.mtmd import capabilities
    path = Path(mmproj)
    if not path.is_file():
        raise UsageError(f"the projector {path} does not exist")
    vision, hears = capabilities(path)
    for kind, able in (("image", vision), ("audio", hears)):
        if any(m.kind == kind for m in given) and not able:
            raise UsageError(f"the projector {path.name} takes no "
                             f"{'images' if kind == 'image' else 'audio'}")
    return str(path)


def chat_projector(model: str, mmproj: str | None) -> str:
    """chat's projector: --mmproj's file, else the one beside the model when there is one (MAYBE:
    a chat without one still runs, and /image says what is missing)."""
    if not mmproj:
        return MAYBE
    from localinfer.backends.llama.mtmd import capabilities
    if not Path(mmproj).is_file():
        raise UsageError(f"the projector {mmproj} does not exist")
    capabilities(Path(mmproj))        # a file that is not a projector: refused before the load
    return mmproj


def load_projector(mmproj: str, model: Path, name: str, backend: str) -> str:
    """LoadOptions.mmproj as the backend takes it: AUTO and MAYBE resolved beside the located
    model file (none there: AUTO is one line before the model loads, MAYBE no projector)."""
    if backend != "llama.cpp":
        if mmproj == MAYBE:
            return ""
        raise UsageError(f"images and audio go through llama.cpp's projector, not {backend}; "
                         "use --backend llama.cpp (or auto)")
    if mmproj not in (AUTO, MAYBE):
        return mmproj
    from localinfer.models.projector import beside
    found = beside(model)
    if found is None and mmproj == AUTO:
        raise UsageError(f"{name} has no projector (mmproj file) for images or audio; name one "
                         "with --mmproj FILE")
    return str(found) if found else ""
