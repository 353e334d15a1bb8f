"""How many tokens one `eval` may carry and still give bit-for-bit the logits of one-at-a-time steps.

Speculative decoding promises the target's own output. That holds only if verifying k drafted tokens
in one batch computes the same logits as k single decode steps would. On llama.cpp's CPU path it
does up to a model-dependent size and not beyond: the repacked matrix kernels treat batch rows in
groups of 4 (Gemma 3 270M Q4_K_M differs from 4 tokens on) and the tiled K-quant kernels take
batches of 8 rows or more. Attention can depend on the context length as well (ggml's flash
attention splits one query's KV range across threads once 512 cells are in view; the llama.cpp
backend picks cache types that keep it off that path, see backends/llama/session.py), so the probe
compares at a short and at a long position. Measured once per compute graph and engine (see
exactness_key.py: a copy of a model with other metadata shares the verdict); drafts are verified
in chunks of at most that size, and a result of 1 means no batch is exact: no drafting.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from localinfer import machine as host_machine    # `machine` names a cache key below
from localinfer.backends import Session
from localinfer.speculate.exactness_key import verdict_key

Notify = Callable[[str], None]

PROBE_VERSION = 3       # part of the cache key: probes made by an earlier rule are made again
SHORT_PREFIX = 4        # a prefill of this many tokens before the first compared positions
LONG_PREFIX = 320       # ... and of this many: llama.cpp then views 512 cells (it pads to 256)
MAX_PROBED = 8          # the largest batch probed; drafts longer than this are verified in chunks
PROBED_POSITIONS = 16   # positions compared after each prefix
# The probe's time: a part that hardly depends on the model (a few hundred small evals) and a part
# that grows with the weights read per eval. Measured on the 2-core build machine (SmolLM2 Q4_1 and
# Gemma 3 270M took about 4 s each); a machine's own probes scale it (`slowdown` in the cache file).
PROBE_BASE_S = 3.0
PROBE_S_PER_MB = 0.01
PROBE_THREADS = 2       # the threads those constants were measured with


def probe_tokens(session: Session) -> list[int]:
    """The probe's text: the start of the bundled `eval` text, enough for the long prefix."""
    text = resources.files("localinfer").joinpath("data", "alice_ch1-3.txt").read_text("utf-8")
    return session.tokenize(text[:4000], special=False)


def probe(session: Session, tokens: Sequence[int], limit: int = MAX_PROBED) -> int:
    """The largest b ≤ limit such that batches of 2..b match single steps exactly, at every prefix.

    Leaves the session's KV cache empty.
    """
    exact = limit
    for prefix in (SHORT_PREFIX, long_prefix(session, tokens)):
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


def exact_batch(session: Session, model_path: Path, backend: str, cache_file: Path, *,
                notify: Notify | None = None) -> int:
    """`probe` for what decides it (exactness_key: the model's graph, not its file; the engine),
    remembered in `cache_file`. `notify` hears one line, with an estimate, before a probe runs."""
    key = verdict_key(session, model_path, backend, PROBE_VERSION)
    tokens = probe_tokens(session)
    viewed = long_prefix(session, tokens)
    known = _read(cache_file)
    entry = known["verdicts"].get(key)
    # A verdict probed in a shorter context never saw the cells a longer one views: probe again.
    if isinstance(entry, dict) and _whole(entry.get("viewed")) >= viewed:
        return max(1, min(_whole(entry.get("exact")), MAX_PROBED))
    expected = PROBE_BASE_S + PROBE_S_PER_MB * model_path.stat().st_size / 1e6
    threads = getattr(session, "n_threads", 0)
    # Layers on a GPU or on --rpc workers run elsewhere, at another pace: a slowdown of their own.
    placed = getattr(getattr(session, "offload", None), "gpu_layers", 0)
    machine = f"{backend}|t{threads}" + (f"|g{placed}" if placed else "")
    if notify is not None:
        notify(_announcement(expected, known["slowdown"].get(machine), threads, placed))
    start = time.perf_counter()
    value = probe(session, tokens)
    known = _read(cache_file)       # another process may have written meanwhile: keep its entries
    known["verdicts"][key] = {"exact": value, "viewed": viewed}
    known["slowdown"][machine] = (time.perf_counter() - start) / expected
    _write(cache_file, known)
    return value


def _announcement(expected: float, slowdown: float | None, threads: int, placed: int) -> str:
    """The line said before a probe: what runs, why, and for how long (unknown the first time
    layers run on a GPU or a worker)."""
    what = "checking once how this model batches"
    if slowdown is None and placed:
        return f"{what} (the first time on this placement: how long is not known yet)"
    if slowdown is None:        # fewer threads than the constants' take longer
        slowdown = _load_factor() * (max(1.0, PROBE_THREADS / threads) if threads else 1.0)
    return f"{what}, ~{max(1, round(expected * slowdown))} s"


def _load_factor() -> float:
    """Before this machine has timed a probe: how much busier its CPUs are than when the constants
    were measured (runnable tasks per CPU; a probe slows down at least as much)."""
    try:
        return max(1.0, os.getloadavg()[0] / host_machine.logical_cpus())
    except (OSError, AttributeError):      # no load average (Windows)
        return 1.0


def long_prefix(session: Session, tokens: Sequence[int]) -> int:
    """The longest prefix `probe` compares at in this session (its context may cut it short)."""
    return max(0, min(LONG_PREFIX, min(len(tokens), session.n_ctx) - PROBED_POSITIONS))


def _whole(value: object) -> int:
    return value if type(value) is int else 0     # a hand-edited or damaged entry is no verdict


def _read(cache_file: Path) -> dict:
    """{"verdicts": {key: {"exact", "viewed"}}, "slowdown": {backend|threads: measured/expected}}."""
    try:
        data = json.loads(cache_file.read_text("utf-8"))
    except (OSError, ValueError):
        data = {}        # absent or corrupt: probe again, never trust it
    data = data if isinstance(data, dict) else {}
    known = {}
    for part in ("verdicts", "slowdown"):
        value = data.get(part)
        known[part] = value if isinstance(value, dict) else {}   # an older file's keys are dropped
    known["slowdown"] = {k: v for k, v in known["slowdown"].items()
                         if isinstance(v, (int, float)) and 0 < v < 1e3}
    return known


def _write(cache_file: Path, data: dict) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1), "utf-8")
        os.replace(tmp, cache_file)     # atomic: a concurrent reader sees old or new, never half
    except OSError:
        pass                            # a read-only cache only costs a probe next time
