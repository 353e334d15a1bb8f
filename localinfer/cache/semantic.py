"""Semantic matching for the answer store (`--reuse-similarity`): a request not found exactly is
answered with the stored answer of a prompt whose embedding is close enough to its own.

Off unless a threshold is given: measured on tests/data/semantic_pairs.jsonl (242 labelled pairs;
docs/answer-reuse.md has the tables), no embedding model here has a threshold that reuses a
useful share of paraphrases without also reusing near misses ("capital of France" for "capital
of Spain", 1921 for 1922, "A beats B" for "B beats A"), so there is no default.

Only the user's text may differ. Everything else decides which entries are compared at all: the
model (its identity, as the exact key has it), the settings of cache/answers.py's key (sampling,
stop strings, max tokens, grammar, thinking budget, logprobs, raw; not the context size, which
run fits to each prompt's length), the prompt's tokens with the user's text replaced by a
placeholder (so the template, the system prompt and the thinking switch), and the embedding
model (its file, size and time: vectors of two models are not comparable). Their digest names a
folder of the store, `<root>/<context>/`, beside the model folders, holding one index entry per
answer stored from such a request: `<request key>.kv`, in the prompt cache's entry format (a
checksummed header naming the full key), whose body is JSON: the answer's request key, the
prompt text as normalised, and its unit-length float32 embedding (base64).

The index lives under the store's rules (atomic writes, the cap and its least-recently-used
eviction, `cache clear`, never through a link), and an entry is checked before anything in it is
used: its name and header against the key it names, the vector's length against the embedder's,
every value finite, its length 1; one that fails is removed and reported in one line. A lookup
reads at most MAX_SCAN entries, the most recently used first.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localinfer.cache import answers, entry, paths, prompt_cache
from localinfer.cache.entry import CorruptEntry

FORMAT = 1
PREFIX = "similar:"             # an index entry's key: this, then the answer's request key
PLACEHOLDER = "\u2063"          # the user's text in the context's tokens (an invisible separator)
MAX_SCAN = 1024                 # index entries one lookup reads, the most recently used first
MAX_PROMPT_CHARS = 4096         # the prompt text an entry keeps (for -v and --json)
MAX_INDEX_BYTES = 256 << 10     # an index entry larger than this is not ours
UNIT = 1e-3                     # how far from 1 a stored vector's length may be
_KEY = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Match:
    """The closest stored prompt at or over the threshold."""

    key: str                # the request key of its answer in the answer store
    similarity: float
    prompt: str


def embedder_identity(path: Path, dimensions: int) -> dict[str, object]:
    """What makes two embedders' vectors comparable: the same file, as the store keys a model."""
    st = path.stat()
    return {"embedder": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "dimensions": dimensions}


def context_key(model_key: str, settings: dict, context_tokens: Sequence[int],
                embedder: dict[str, object]) -> str:
    """The digest of everything but the user's text (see the module's docstring)."""
    digest = hashlib.sha256(json.dumps(
        {"model": model_key, "settings": {k: v for k, v in settings.items() if k != "n_ctx"},
         "embedder": embedder, "format": FORMAT}, sort_keys=True, default=str).encode())
    digest.update(np.asarray(context_tokens, dtype="<i4").tobytes())
    return digest.hexdigest()


class SemanticIndex:
    """The index entries of one context under the answer store's `root`; `dimensions` is the
    embedder's vector length, `notify` hears of each entry refused."""

    def __init__(self, root: Path, context: str, *, dimensions: int, label: str,
                 notify: Callable[[str], None] = lambda line: None) -> None:
        self.root, self.dimensions, self.label, self.notify = root, dimensions, label, notify
        self.dir = root / f"s{context[:15]}"

    def find(self, vector: np.ndarray, threshold: float) -> Match | None:
        """The stored prompt most similar to `vector`, if its cosine is at least `threshold`."""
        if not paths.is_key_dir(self.root, self.dir):
            if os.path.lexists(self.dir):   # a link or a file in a folder's place: never followed
                self._refuse(self.dir, "its folder is not a folder of the store")
            return None
        best: tuple[float, Path, str, str] | None = None
        for path in self._recent():
            read = self._read(path)
            if read is None:
                continue
            key, stored, prompt = read
            similarity = float(np.dot(stored, vector))
            if best is None or similarity > best[0]:
                best = (similarity, path, key, prompt)
        if best is None or best[0] < threshold:
            return None
        prompt_cache._touch(best[1])
        return Match(best[2], best[0], best[3])

    def add(self, key: str, vector: np.ndarray, prompt: str) -> Path | None:
        """Index the answer stored under `key` by its prompt's embedding (atomically); nothing
        on a full disk or a read-only store."""
        body = json.dumps({"format": FORMAT, "key": key, "prompt": prompt[:MAX_PROMPT_CHARS],
                           "vector": base64.b64encode(
                               np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")},
                          ensure_ascii=False).encode()
        if not paths.prepare_key_dir(self.root, self.dir):
            return None
        path = self.path(key)
        try:
            entry.write(path, key=PREFIX + key, label=self.label, tokens=[], state=body)
        except (OSError, ValueError):
            return None
        return path

    def drop(self, key: str) -> None:
        """Remove the index entry of an answer the store no longer has."""
        paths.remove(self.root, self.path(key))

    def path(self, key: str) -> Path:
        return self.dir / f"{key[:32]}{paths.SUFFIX}"

    def _recent(self) -> list[Path]:
        files = []
        for path in paths.files_in(self.root, self.dir):
            try:
                files.append((os.lstat(path).st_mtime, path))
            except OSError:
                continue
        return [path for _, path in sorted(files, reverse=True)[:MAX_SCAN]]

    def _read(self, path: Path) -> tuple[str, np.ndarray, str] | None:
        try:
            size = os.lstat(path).st_size
            if size > MAX_INDEX_BYTES:
                raise CorruptEntry(f"{size:,} bytes, more than an index entry takes")
            head = entry.read_head(path)
            if head.tokens or not head.key.startswith(PREFIX) or \
                    head.key[len(PREFIX):len(PREFIX) + 32] != path.stem:
                raise CorruptEntry("not this index entry")
            return parse(entry.read_state(head, head.key), head.key[len(PREFIX):],
                         self.dimensions)
        except CorruptEntry as e:
            self._refuse(path, str(e))
        except OSError:
            pass                    # removed meanwhile
        return None

    def _refuse(self, path: Path, why: str) -> None:
        answers.drop(self.root, self.dir, path)
        self.notify(f"answer store: dropped index entry {path.stem[:12]} ({why}); "
                    "it is not matched")


def parse(body: bytes, key: str, dimensions: int) -> tuple[str, np.ndarray, str]:
    """An index entry's (request key, unit vector, prompt), every field checked; CorruptEntry
    otherwise."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise CorruptEntry("not an index entry: bad JSON") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CorruptEntry("not an index entry of this format")
    if data.get("key") != key or not isinstance(key, str) or not _KEY.fullmatch(key):
        raise CorruptEntry("names another answer")
    prompt, encoded = data.get("prompt"), data.get("vector")
    if not isinstance(prompt, str) or len(prompt) > MAX_PROMPT_CHARS:
        raise CorruptEntry("bad prompt")
    if not isinstance(encoded, str) or len(encoded) > 8 * dimensions:
        raise CorruptEntry("bad vector")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise CorruptEntry("bad vector") from None
    if len(raw) != 4 * dimensions:
        raise CorruptEntry(f"a vector of {len(raw) // 4} values, not the embedder's {dimensions}")
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(vector).all() or abs(float(np.linalg.norm(vector)) - 1.0) > UNIT:
        raise CorruptEntry("a vector that is not of unit length")
    return key, vector, prompt
