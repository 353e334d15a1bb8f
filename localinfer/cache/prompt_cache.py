"""The persistent prompt cache: KV states of earlier prompts on disk, found by longest token prefix.

One directory per cache key (model file identity, backend and every setting that shapes the KV
state), one file per entry (see cache_entry). No index file and no locks: lookup reads the entries'
headers, writes are atomic renames, and a file another process deleted meanwhile is simply skipped,
so two `localinfer` processes can share the cache without corrupting it or waiting on each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from localinfer.cache import entry, paths
from localinfer.cache.entry import CorruptEntry, EntryHead
from localinfer.engine.kv import common_prefix

DEFAULT_CAP_BYTES = 2_000_000_000
_STALE_TEMP_S = 3600           # a temporary file this old belongs to a process that died mid-write


@dataclass(frozen=True)
class Usage:
    entries: int
    bytes: int
    tokens: int


class PromptCache:
    """The entries of one cache key under `root`, capped at `cap_bytes` for the whole cache."""

    def __init__(self, root: Path, identity: dict[str, object], *, label: str, cap_bytes: int):
        self.root, self.label, self.cap_bytes = root, label, cap_bytes
        self.key = json.dumps(identity, sort_keys=True, default=str)
        self.dir = root / hashlib.sha256(self.key.encode()).hexdigest()[:16]

    def longest_prefix(self, tokens: Sequence[int], *, limit: int | None = None,
                       rigid_over: int | None = None,
                       longest: int | None = None) -> tuple[EntryHead, int] | None:
        """The entry sharing the longest token prefix with `tokens`, and the length shared, counted
        up to `limit`. An entry longer than `rigid_over` tokens cannot be trimmed back once
        restored: it counts only when it is wholly a prefix of `tokens` and no longer than `limit`.
        An entry of more than `longest` tokens (the session's context) is passed over, and kept:
        the key leaves the context size out, so a run with a larger context may use it.
        """
        best: tuple[EntryHead, int] | None = None
        for head in self._heads():
            if longest is not None and len(head.tokens) > longest:
                continue
            shared = common_prefix(head.tokens, tokens)
            if rigid_over is not None and len(head.tokens) > rigid_over and (
                    shared < len(head.tokens) or (limit is not None and shared > limit)):
                continue
            if limit is not None:
                shared = min(shared, limit)
            if shared and (best is None or shared > best[1]):
                best = (head, shared)
        return best

    def load(self, head: EntryHead) -> bytes | None:
        """The entry's verified state, or None after dropping an entry that fails verification."""
        try:
            state = entry.read_state(head, self.key)
        except CorruptEntry:
            paths.remove(self.root, head.path)
            return None
        except OSError:          # deleted by another process since lookup
            return None
        _touch(head.path)
        return state

    def drop(self, head: EntryHead) -> None:
        paths.remove(self.root, head.path)

    def save(self, tokens: Sequence[int], state: bytes) -> Path | None:
        """Store the state of `tokens`, then evict least-recently-used entries over the cap."""
        size_guess = len(state) + 4 * len(tokens)
        if not tokens or self.cap_bytes <= 0 or size_guess > self.cap_bytes:
            return None
        name = hashlib.sha256(self.key.encode() + np.asarray(tokens, "<i4").tobytes()).hexdigest()
        path = self.dir / f"{name[:32]}{entry.SUFFIX}"
        if not paths.prepare_key_dir(self.root, self.dir):
            return None
        try:
            entry.write(path, key=self.key, label=self.label, tokens=list(tokens),
                              state=state)
        except OSError:          # a full disk or a read-only cache: the answer matters, not the cache
            return None
        evict(self.root, self.cap_bytes, keep=path)
        return path

    def _heads(self) -> list[EntryHead]:
        heads = []
        for path in paths.files_in(self.root, self.dir):
            try:
                heads.append(entry.read_head(path))
            except CorruptEntry:
                paths.remove(self.root, path)
            except OSError:
                continue
        return heads


def entries(root: Path) -> list[EntryHead]:
    """Every readable entry under root, most recently used first (corrupt ones are skipped)."""
    heads = []
    for path in paths.all_files(root):
        try:
            heads.append(entry.read_head(path))
        except (CorruptEntry, OSError):
            continue
    return sorted(heads, key=lambda h: h.last_used, reverse=True)


def usage(root: Path) -> Usage:
    heads = entries(root)
    return Usage(len(heads), sum(h.size for h in heads), sum(len(h.tokens) for h in heads))


def evict(root: Path, cap_bytes: int, *, keep: Path | None = None) -> int:
    """Delete least-recently-used entries until the cache fits cap_bytes; returns how many."""
    _remove_stale_temps(root)
    files = []
    for path in paths.all_files(root):
        try:
            st = path.stat()
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    removed = 0
    for _, size, path in sorted(files, key=lambda f: f[0]):
        if total <= cap_bytes:
            break
        if path == keep:
            continue
        paths.remove(root, path)
        total -= size
        removed += 1
    return removed


def clear(root: Path) -> Usage:
    """Delete every entry; returns what was there."""
    before = usage(root)
    for path in paths.all_files(root):
        paths.remove(root, path)
    return before


def _remove_stale_temps(root: Path) -> None:
    now = time.time()
    for path in paths.all_files(root, temporary=True):
        try:
            if now - path.stat().st_mtime > _STALE_TEMP_S:
                paths.remove(root, path)
        except OSError:
            continue


def _touch(path: Path) -> None:
    try:   # the entry itself, never what a link swapped in since lookup points to
        os.utime(path, follow_symlinks=os.utime not in os.supports_follow_symlinks)
    except OSError:
        pass


def open_for(session, *, enabled: bool = True) -> PromptCache | None:
    """The prompt cache for a loaded session, or None when disabled (--no-cache or a cap of 0)."""
    from localinfer import settings
    from localinfer.engine.batching import LAYOUT
    conf = settings.load()
    cap = conf.prompt_cache_bytes
    cap = DEFAULT_CAP_BYTES if cap is None else cap
    if not enabled or cap <= 0:
        return None
    identity = {**session.state_identity(), "batching": LAYOUT, "format": entry.VERSION}
    return PromptCache(conf.prompt_cache_dir, identity, label=Path(str(identity["model"])).name,
                       cap_bytes=cap)


def persist(cache, *, notify=None) -> None:
    """Write the KVCache's pending entry (after the reply, so it costs no time to first token)."""
    start = time.perf_counter()
    saved = cache.persist()
    if notify and saved:
        notify(f"prompt cache: saved {saved} tokens in {(time.perf_counter() - start) * 1000:.0f} ms")


def describe(event) -> str:
    """The -v line for a kv.CacheEvent."""
    if event is None:
        return "prompt cache: not consulted"
    if event.hit:
        return (f"prompt cache: hit · {event.restored} tokens restored in "
                f"{event.seconds * 1000:.0f} ms")
    return f"prompt cache: {event.note}"
