"""One prompt-cache entry on disk: a self-describing file that is verified before it is trusted.

Layout: MAGIC, a little-endian u32 header length, a JSON header, the prompt tokens (int32 LE), then
the engine's KV state. The header names the cache key the entry belongs to and a SHA-256 of tokens
and state, so a truncated file, flipped bytes or an entry copied from another model's cache are all
caught on read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from localinfer.cache.paths import SUFFIX, TEMP_PREFIX

MAGIC = b"LIPCACHE"
VERSION = 1
MAX_HEAD = 1 << 20      # a header holds the cache key and a few numbers: a few hundred bytes
_LEN = struct.Struct("<I")


class CorruptEntry(Exception):
    """The file is not a complete, intact entry for the expected key."""


@dataclass(frozen=True)
class EntryHead:
    """What lookup needs from an entry, read without touching the (large) state."""

    path: Path
    key: str
    tokens: list[int]
    state_len: int
    checksum: str
    data_offset: int           # where the state starts in the file
    size: int                  # bytes on disk
    last_used: float           # mtime: refreshed on every hit, so eviction is least-recently-used
    label: str                 # the model file's name, for `localinfer cache ls`


def write(path: Path, *, key: str, label: str, tokens: list[int], state: bytes) -> None:
    """Write an entry atomically: readers see the old file or the whole new one, never a part."""
    token_bytes = np.asarray(tokens, dtype="<i4").tobytes()
    digest = hashlib.sha256(token_bytes)
    digest.update(state)
    head = json.dumps({"version": VERSION, "key": key, "label": label, "n_tokens": len(tokens),
                       "state_len": len(state), "sha256": digest.hexdigest()}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(head)) + head)
            f.write(token_bytes)
            f.write(state)
        os.replace(tmp, path)   # two processes writing the same entry: the last complete one wins
    except BaseException:
        _unlink(Path(tmp))
        raise


def read_head(path: Path) -> EntryHead:
    """The header and tokens of an entry; raises CorruptEntry if they cannot be parsed.

    Every count in the file is checked against the file's size before it sizes a read, so a
    damaged entry costs no more memory than the file holds."""
    with _open(path) as f:
        st = os.fstat(f.fileno())
        fixed = f.read(len(MAGIC) + _LEN.size)
        if len(fixed) < len(MAGIC) + _LEN.size or not fixed.startswith(MAGIC):
            raise CorruptEntry("bad magic")
        (head_len,) = _LEN.unpack(fixed[len(MAGIC):])
        if head_len > min(MAX_HEAD, st.st_size):
            raise CorruptEntry("bad header length")
        head = _parse_head(f.read(head_len))
        n_tokens, state_len = head["n_tokens"], head["state_len"]
        offset = len(MAGIC) + _LEN.size + head_len + 4 * n_tokens
        if st.st_size != offset + state_len:
            raise CorruptEntry("truncated")
        token_bytes = f.read(4 * n_tokens)
    if len(token_bytes) != 4 * n_tokens:
        raise CorruptEntry("truncated")
    tokens = np.frombuffer(token_bytes, dtype="<i4").tolist()
    return EntryHead(path, head["key"], tokens, state_len, head["sha256"], offset, st.st_size,
                     st.st_mtime, head["label"])


def _parse_head(raw: bytes) -> dict:
    """The JSON header with the type of every field checked; CorruptEntry otherwise."""
    try:
        head = json.loads(raw)
    except (ValueError, RecursionError) as e:     # UnicodeDecodeError is a ValueError
        raise CorruptEntry(f"bad header: {type(e).__name__}") from None
    if not isinstance(head, dict):
        raise CorruptEntry("bad header: not an object")
    if head.get("version") != VERSION:
        raise CorruptEntry("another format version")
    for field in ("n_tokens", "state_len"):
        value = head.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CorruptEntry(f"bad header: {field}")
    for field in ("key", "sha256"):
        if not isinstance(head.get(field), str):
            raise CorruptEntry(f"bad header: {field}")
    label = head.get("label", "")
    head["label"] = label if isinstance(label, str) else ""
    return head


def read_state(head: EntryHead, key: str) -> bytes:
    """The verified KV state of an entry whose head was read; raises CorruptEntry if anything is off."""
    if head.key != key:
        raise CorruptEntry("entry belongs to another model or settings")
    with _open(head.path) as f:
        f.seek(head.data_offset - 4 * len(head.tokens))
        token_bytes = f.read(4 * len(head.tokens))
        state = f.read(head.state_len + 1)   # one byte more: a file that grew is wrong too
    if len(state) != head.state_len:
        raise CorruptEntry("truncated")
    if np.frombuffer(token_bytes, dtype="<i4").tolist() != head.tokens:
        raise CorruptEntry("changed while reading")
    digest = hashlib.sha256(token_bytes)
    digest.update(state)
    if digest.hexdigest() != head.checksum:
        raise CorruptEntry("checksum mismatch")
    return state


def _open(path: Path) -> BinaryIO:
    """An entry opened for reading: never through a symlink, and only a regular file (reading a
    FIFO put in its place would block forever)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
        getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptEntry("a symlink, not an entry") from None
        raise
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise CorruptEntry("not a regular file")
    return f


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
