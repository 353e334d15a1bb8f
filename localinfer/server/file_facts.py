"""What the server says of a model file without loading it (Ollama's /api/tags, /api/show and
/api/ps; the lists of /v1/models): its size, date, header entries and parameter count, read
once per file, and its sha256, computed once, in the background.

A file is known by its identity (path, size, mtime_ns, inode): a file replaced or rewritten is
read again, one left alone never is. Reading a header takes milliseconds and happens on the
caller's thread (a request's worker thread, never the event loop); hashing a file of gigabytes
takes seconds to minutes, so a digest not known yet is "" (a string still, as Ollama's clients
expect) and one thread computes it meanwhile, one file at a time, with no lock held while it
reads. A file whose header cannot be read (damaged, cut short, not a GGUF) is refused with one
log line per identity, not once per listing.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from localinfer.errors import LocalinferError, ModelLoadError

MAX_KNOWN = 4096        # identities remembered (a store holds far fewer files; each change is one)
Identity = tuple[str, int, int, int]


@dataclass(frozen=True)
class Facts:
    """One model file's facts, from its header (a split model: every part's)."""

    size: int                       # bytes of every part
    modified_at: str                # RFC 3339, as Ollama writes it
    metadata: dict                  # the header's entries, as gguf.header reads them
    parameters: int                 # elements of every tensor


NO_FILE = Facts(0, "1970-01-01T00:00:00Z", {}, 0)    # a server made without a file (tests)


class FileFacts:
    """Facts and digests of model files, by identity; `log` hears one line per unreadable file."""

    def __init__(self, log: Callable[[str], None] = lambda line: None,
                 hash_file: Callable[[Path], str] | None = None) -> None:
        self._log = log
        self._hash = hash_file or _sha256
        self._lock = threading.Lock()           # held for dict work only, never for a read
        self._facts: OrderedDict[Identity, Facts | LocalinferError] = OrderedDict()
        self._digests: OrderedDict[Identity, str] = OrderedDict()
        self._hashing: set[Identity] = set()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="localinfer-digest")

    def read(self, path: Path | None) -> Facts:
        """The file's facts (blocking: a stat, and a header read the first time); a
        ModelLoadError for a file that cannot be described."""
        if path is None:
            return NO_FILE
        key = _identity(path)
        with self._lock:
            known = self._facts.get(key)
        if known is None:
            try:
                known = _read(path)
            except Exception as e:      # noqa: BLE001 - whatever the reason, it is not listed
                known = e if isinstance(e, LocalinferError) else \
                    ModelLoadError(f"cannot read {path}: {type(e).__name__}: {e}")
                said = str(known) if str(path) in str(known) else f"{path}: {known}"
                self._log(f"left out of the model lists: {said}")
            with self._lock:
                _remember(self._facts, key, known)
        if isinstance(known, LocalinferError):
            raise known
        return known

    def readable(self, path: Path | None) -> bool:
        try:
            self.read(path)
        except LocalinferError:
            return False
        return True

    def digest(self, path: Path | None) -> str:
        """The file's sha256 if known, else "" and it is computed in the background."""
        if path is None:
            return ""
        try:
            key = _identity(path)
        except LocalinferError:
            return ""
        with self._lock:
            known = self._digests.get(key)
            if known is not None or key in self._hashing:
                return known or ""
            self._hashing.add(key)
        self._hasher.submit(self._compute, path, key)
        return ""

    def _compute(self, path: Path, key: Identity) -> None:
        try:
            digest = self._hash(path)
        except OSError:             # gone or unreadable since: asked again, tried again
            digest = None
        with self._lock:
            self._hashing.discard(key)
            if digest is not None and _still(path, key):
                _remember(self._digests, key, digest)


def _identity(path: Path) -> Identity:
    try:
        st = os.stat(path)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
    return str(path), st.st_size, st.st_mtime_ns, st.st_ino


def _still(path: Path, key: Identity) -> bool:
    """Whether the file is still the one that was hashed (not rewritten meanwhile)."""
    try:
        return _identity(path) == key
    except LocalinferError:
        return False


def _remember(known: OrderedDict, key: Identity, value) -> None:
    known[key] = value
    known.move_to_end(key)
    while len(known) > MAX_KNOWN:
        known.popitem(last=False)


def _read(path: Path) -> Facts:
    from localinfer.gguf.header import read_header
    from localinfer.gguf.split import whole_model
    try:
        header, size = whole_model(path, read_header(path))
        modified = os.stat(path).st_mtime
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
    return Facts(size, rfc3339(modified), header.metadata,
                 sum(t.n_elements for t in header.tensors))


def _sha256(path: Path) -> str:
    from localinfer.models.fetch import sha256_of
    return sha256_of(path)


def rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
