"""Log-probabilities of the tokens a generation emits, and of the likeliest alternatives.

They are the model's own: the log-softmax over the RAW logits row the model produced for that
position, before any repeat, frequency or presence penalty, logit bias, temperature, top-k, top-p
or min-p, and before a grammar's mask. That is what OpenAI and vLLM report by default, and it makes
a token's log-probability a property of the model and the text alone: the same under any sampling
settings, under speculative decoding and in the batch scheduler wherever those give the same logits.

Per token this costs one pass over the vocabulary-sized row for its maximum (block by block, the
blocks' maxima then bound the top N from below, so only the few logits above that bound are
sorted: a partition of 262k logits would cost more than the rest together), one exponential per
logit in float32 summed in float64, and, with a top list, one comparison pass. No logit is left
out of the normaliser: real rows have nearly the whole vocabulary within 40 nats of the best
token, so a cut-off would save nothing (docs/logprobs.md has the measurements).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

MAX_TOP = 20          # the most alternatives asked for (OpenAI's top_logprobs bound)
BLOCK = 256           # logits per block whose maxima bound the top N (see the module's doc)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the raw logits, and the `top` likeliest tokens
    with theirs (best first; equal logits by token id), as many as asked for."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top(n: int | None, name: str = "logprobs") -> int | None:
    """`n` as a Limits.logprobs value: None (off), or 0..MAX_TOP; anything else is refused."""
    from localinfer.errors import UsageError
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP:
        raise UsageError(f"{name} must be a whole number from 0 to {MAX_TOP}, not {n!r}")
    return n


def token_logprob(row: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """`token`'s log-probability under the logits `row`, with the `top` likeliest tokens'."""
    top = min(top, len(row))
    whole = len(row) // BLOCK * BLOCK
    maxima = row[:whole].reshape(-1, BLOCK).max(axis=1)
    if whole < len(row):
        maxima = np.append(maxima, row[whole:].max())
    best = float(maxima.max())
    if not math.isfinite(best):          # a broken row (nan, inf): no distribution to report
        return _unscorable(row, token, top)
    norm = best + math.log(_exp_sum(row, best))
    logprob = float(row[token]) - norm
    if top == 0:
        return TokenLogprob(token, logprob)
    # The top-th largest block maximum is at most the top-th largest logit: every token of the
    # top list is at or above it, in a block whose maximum is, and few blocks' are.
    bound = np.partition(maxima, len(maxima) - top)[len(maxima) - top] \
        if len(maxima) >= top else row.min()       # fewer blocks than asked for: all of them
    ids = np.concatenate([np.arange(b * BLOCK, min((b + 1) * BLOCK, len(row)))
                          for b in np.flatnonzero(maxima >= bound).tolist()])
    ids = ids[row[ids] >= bound]
    values = row[ids]
    order = np.lexsort((ids, -values))[:top]       # best first, equal logits by token id
    return TokenLogprob(token, logprob,
                        tuple((int(ids[i]), float(values[i]) - norm) for i in order))


_scratch = threading.local()


def _exp_sum(row: np.ndarray, best: float) -> float:
    """The sum of exp(row - best), in float32 exponentials summed in float64. The exponentials
    go to a buffer this thread keeps: a fresh vocabulary-sized array each token costs the
    memory allocator page faults that more than double the time."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) != len(row):
        buf = _scratch.buf = np.empty(len(row), dtype=np.float32)
    np.subtract(row, best, out=buf, casting="unsafe")
    np.exp(buf, out=buf)
    return float(buf.sum(dtype=np.float64))


def _unscorable(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """A row with no finite maximum gives nan: the engine produced no distribution here."""
    nan = float("nan")
    return TokenLogprob(token, nan, tuple((int(i), nan) for i in range(top)))


def records(logprobs: list[TokenLogprob], piece: Callable[[int], bytes]) -> list[dict]:
    """The log-probabilities as `run --json`, `map --jsonl` and the Python API give them: per
    token its text, id, logprob, bytes (a token may hold part of a character: its text then has
    U+FFFD, the bytes are exact) and the top list in the same form. `piece` is the session's."""
    def one(token: int, logprob: float) -> dict:
        raw = piece(token)
        return {"token": raw.decode("utf-8", "replace"), "id": token,
                "logprob": logprob if math.isfinite(logprob) else None, "bytes": list(raw)}
    return [one(lp.token, lp.logprob) | {"top": [one(t, v) for t, v in lp.top]}
            for lp in logprobs]
