"""Every cache the tool writes, for `cache stats` and `cache clear`: what each holds, where, and
how much. Each can be made again (at a cost: a prefill, a probe, a quantization, an export), so
clearing one loses time, never a model or a setting.

The prompt cache and the answer store have their own entry rules (prompt_cache, answers,
paths); the rest are files and folders
removed as they are: a symlink is unlinked, never followed (a link planted in a cache must not
turn a clear into a delete elsewhere). Anything else in the cache folder (a cache a later version
writes, a leftover) counts and is cleared as `other`.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from localinfer.cache import answers, prompt_cache

VERDICTS = "exact_batch.json"       # speculate/choose.py: the batching check's verdicts
FRONTIER = "frontier"               # measure/frontier.py: reference and variants per model
PROJECTORS = "projectors.json"      # backends/llama/projector_check.py: projector files' trials
PROMPTS = "prompts"
ANSWERS = "answers"
ENTRIES = {PROMPTS: prompt_cache, ANSWERS: answers}     # kinds counted and cleared by entry


@dataclass(frozen=True)
class Kind:
    name: str
    what: str
    paths: tuple[Path, ...]


@dataclass(frozen=True)
class Usage:
    kind: Kind
    files: int
    bytes: int


def kinds(conf) -> list[Kind]:
    """The caches under `conf` (settings.Settings), in the order `cache stats` lists them."""
    cache, models = conf.cache_dir, conf.models_dir
    known = {conf.prompt_cache_dir.name, answers.FOLDER, VERDICTS, FRONTIER, PROJECTORS}
    others = tuple(p for p in _children(cache) if p.name not in known)
    return [
        Kind(PROMPTS, "prompt cache: KV states of earlier prompts", (conf.prompt_cache_dir,)),
        Kind(ANSWERS, "answer store: deterministic answers (--reuse-answers)",
             (cache / answers.FOLDER,)),
        Kind("batching", "how each model batches, checked once for speculative decoding",
             (cache / VERDICTS,)),
        Kind(FRONTIER, "frontier's references and quantized variants", (cache / FRONTIER,)),
        Kind("projectors", "image and audio projector files, each tried once in a child process",
             (cache / PROJECTORS,)),
        Kind("mlx", "MLX conversions of GGUF files", (models / ".mlx",)),
        Kind("onnx", "ONNX exports of GGUF files and their NPU checks", (models / ".onnx",)),
        Kind("other", "anything else in the cache folder", others),
    ]


def usage(kind: Kind) -> Usage:
    if kind.name in ENTRIES:
        use = ENTRIES[kind.name].usage(kind.paths[0])
        return Usage(kind, use.entries, use.bytes)
    files = size = 0
    for path in kind.paths:
        for st in _walk(path):
            files += 1
            size += st.st_size
    return Usage(kind, files, size)


def clear(kind: Kind) -> Usage:
    """Remove what the cache holds; returns what was there."""
    before = usage(kind)
    if kind.name in ENTRIES:
        ENTRIES[kind.name].clear(kind.paths[0])
        return before
    for path in kind.paths:
        _remove(path)
    return before


def _children(folder: Path) -> list[Path]:
    try:
        return sorted(folder / name for name in os.listdir(folder))
    except OSError:
        return []


def _walk(path: Path):
    """lstat of every file at or under `path`, links counted as themselves, never followed."""
    pending = [path]
    while pending:                  # a stack, not recursion: a planted tree may be deep
        here = pending.pop()
        try:
            st = os.lstat(here)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            pending.extend(_children(here))
        else:
            yield st


def _remove(path: Path) -> None:
    try:
        st = os.lstat(path)
    except OSError:
        return                  # not there, or gone meanwhile (another process cleared it)
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)     # removes links inside, follows none
        else:
            path.unlink()
    except (OSError, RecursionError):    # what cannot go stays; the next clear tries again
        pass
