"""How many tokens one `eval` may carry and still give bit-for-bit the logits of one-at-a-time steps.

Speculative decoding promises the target's own output. That holds only if verifying k drafted tokens
in one batch computes the same logits as k single decode steps would. On llama.cpp's CPU path it
does up to a model-dependent size and not beyond: the repacked matrix kernels treat batch rows in
groups of 4 (Gemma 3 270M Q4_K_M differs from 4 tokens on) and the tiled K-quant kernels take
batches of 8 rows or more. Attention can depend on the context length as well (ggml's flash
attention splits one query's KV range across threads once 512 cells are in view; the llama.cpp
backend picks cache types that keep it off that path, see backends/llama_cpp.py), so the probe
compares at a short and at a long position. Measured once per model file and engine; drafts are
verified in chunks of at most that size, and a result of 1 means no batch is exact: no drafting.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np

from localinfer.backends import Session

PROBE_VERSION = 2       # part of the cache key: probes made by an earlier rule are made again
SHORT_PREFIX = 4        # a prefill of this many tokens before the first compared positions
LONG_PREFIX = 320       # ... and of this many: llama.cpp then views 512 cells (it pads to 256)
MAX_PROBED = 8          # the largest batch probed; drafts longer than this are verified in chunks
PROBED_POSITIONS = 16   # positions compared after each prefix


def probe_tokens(session: Session) -> list[int]:
    """The probe's text: the start of the bundled `eval` text, enough for the long prefix."""
    text = resources.files("localinfer").joinpath("data", "alice_ch1-3.txt").read_text("utf-8")
    return session.tokenize(text[:4000], special=False)


def probe(session: Session, tokens: Sequence[int], limit: int = MAX_PROBED) -> int:
    """The largest b ≤ limit such that batches of 2..b match single steps exactly, at every prefix.

    Leaves the session's KV cache empty.
    """
    exact = limit
    longest = min(len(tokens), session.n_ctx) - PROBED_POSITIONS
    for prefix in (SHORT_PREFIX, min(LONG_PREFIX, longest)):
        if prefix < 1 or exact < 2:
            break
        exact = _probe_at(session, tokens[:prefix + PROBED_POSITIONS], prefix, exact)
    session.reset()
    return exact


def _probe_at(session: Session, tokens: Sequence[int], prefix: int, limit: int) -> int:
    """`probe` after one prefix; rows are compared by digest, so no vocabulary-wide copies pile up."""
    head, rest = list(tokens[:prefix]), list(tokens[prefix:])
    session.reset()
    session.eval(head)
    reference = [_digest(session.eval([t])) for t in rest]
    exact = 1
    for size in range(2, limit + 1):
        if not session.trim(prefix):
            session.reset()
            session.eval(head)
        digests = []
        for i in range(0, len(rest), size):
            digests.extend(_digest(row) for row in session.eval(rest[i:i + size], logits="all"))
        if digests != reference:
            break
        exact = size
    return exact


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=16).digest()


def exact_batch(session: Session, model_path: Path, backend: str, cache_file: Path) -> int:
    """`probe` for this model file and engine, remembered in `cache_file` (a small JSON map)."""
    key = _key(session, model_path, backend)
    known = _read(cache_file)
    if key in known:
        return int(known[key])
    value = probe(session, probe_tokens(session))
    known[key] = value
    _write(cache_file, known)
    return value


def _key(session: Session, path: Path, backend: str) -> str:
    stat = path.stat()
    engine = getattr(session, "engine_version", "")
    threads = getattr(session, "n_threads", 0)
    kv = getattr(session, "kv_type", "")
    # Layers on a GPU run its kernels, which batch differently: a probe per placement.
    gpu_layers = getattr(getattr(session, "offload", None), "gpu_layers", 0)
    return (f"{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}|{backend}{engine}|t{threads}"
            f"|kv{kv}|p{PROBE_VERSION}" + (f"|gpu{gpu_layers}" if gpu_layers else ""))


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
