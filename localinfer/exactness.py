"""How many tokens one `eval` may carry and still give bit-for-bit the logits of one-at-a-time steps.

Speculative decoding promises the target's own output. That holds only if verifying k drafted tokens
in one batch computes the same logits as k single decode steps would. On llama.cpp's CPU path it
does up to a model-dependent size and not beyond: some matrix kernels switch to a differently
accumulated variant for larger batches (measured here: Gemma 3 270M Q4_K_M with repacked weights
differs from 4 tokens on, in 0.7 % of greedy choices; SmolLM2 with flash attention never does).
So we measure it once per model file and engine and verify drafts in chunks of at most that size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from localinfer.backends import Session

PROBE_TEXT = ("Speculative decoding checks several guessed tokens at once; the answer must not "
              "change. The quick brown fox jumps over the lazy dog, 42 times in 1024 ways.")
PROBE_PREFIX = 4        # evaluated as a prefill before the compared positions
MAX_PROBED = 8          # the largest batch probed; drafts longer than this are verified in chunks


def probe(session: Session, tokens: Sequence[int], limit: int = MAX_PROBED) -> int:
    """The largest b ≤ limit such that evaluating in batches of 2..b matches single steps exactly.

    Leaves the session's KV cache empty.
    """
    prefix, rest = list(tokens[:PROBE_PREFIX]), list(tokens[PROBE_PREFIX:])
    session.reset()
    session.eval(prefix)
    reference = np.stack([session.eval([t]).copy() for t in rest])
    exact = 1
    for size in range(2, limit + 1):
        session.reset()
        session.eval(prefix)
        rows = [session.eval(rest[i:i + size], logits="all").copy()
                for i in range(0, len(rest), size)]
        if not np.array_equal(np.concatenate(rows), reference):
            break
        exact = size
    session.reset()
    return exact


def exact_batch(session: Session, model_path: Path, backend: str, cache_file: Path) -> int:
    """`probe` for this model file and engine, remembered in `cache_file` (a small JSON map)."""
    key = _key(session, model_path, backend)
    known = _read(cache_file)
    if key in known:
        return int(known[key])
    tokens = session.tokenize(PROBE_TEXT, special=False)
    value = probe(session, tokens)
    known[key] = value
    _write(cache_file, known)
    return value


def _key(session: Session, path: Path, backend: str) -> str:
    stat = path.stat()
    engine = getattr(session, "engine_version", "")
    threads = getattr(session, "n_threads", 0)
    return f"{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}|{backend}{engine}|t{threads}"


def _read(cache_file: Path) -> dict:
    try:
        data = json.loads(cache_file.read_text("utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}        # absent or corrupt: probe again, never trust it


def _write(cache_file: Path, data: dict) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1), "utf-8")
        os.replace(tmp, cache_file)     # atomic: a concurrent reader sees old or new, never half
    except OSError:
        pass                            # a read-only cache only costs a probe next time
