"""Log-probabilities of the tokens a generation emits, and of the likeliest alternatives.

They are the model's own: the log-softmax over the RAW logits row the model produced for that
position, before any repeat, frequency or presence penalty, logit bias, temperature, top-k, top-p
or min-p, and before a grammar's mask. That is what OpenAI and vLLM report by default, and it makes
a token's log-probability a property of the model and the text alone: the same under any sampling
settings, under speculative decoding and in the batch scheduler wherever those give the same logits.

Per token this costs a few passes over the vocabulary-sized row: the maxima of GROUPS strided
groups of logits (every GROUPS-th token: an elementwise maximum of the row's lines, which numpy
vectorises, where maxima of contiguous blocks it does not), which give the best logit and bound
the top N from below, so only the few groups that reach the bound are sorted (a partition of
262k logits would cost more than everything else together); then one exponential per logit in
float32, summed pairwise. No logit is left out of the normaliser: real rows have nearly the whole
vocabulary within 40 nats of the best token, so a cut-off would save nothing (docs/logprobs.md
has the measurements and the error against a float64 log-softmax).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

MAX_TOP = 20          # the most alternatives asked for (OpenAI's top_logprobs bound)
GROUPS = 1024         # strided groups whose maxima bound the top N (see the module's doc)
DIRECT = (-20.0, 60.0)    # best logits whose row is exponentiated as it is (see _exp_sum)


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
    lines = len(row) // GROUPS
    grid = row[:lines * GROUPS].reshape(lines, GROUPS)     # group g: tokens g, g + GROUPS, ...
    maxima = grid.max(axis=0) if lines else row[:0]
    rest = row[lines * GROUPS:]                            # the tail, no group's: always looked at
    best = float(max(maxima.max(initial=-np.inf), rest.max(initial=-np.inf)))
    if not math.isfinite(best):          # a broken row (nan, inf): no distribution to report
        return _unscorable(row, token, top)
    norm = best + math.log(_exp_sum(row, best))
    logprob = float(row[token]) - norm
    if top == 0:
        return TokenLogprob(token, logprob)
    ids = np.arange(lines * GROUPS, len(row))
    if lines:
        # The top-th largest group maximum is at most the top-th largest logit: every token of
        # the top list is at or above it, in a group whose maximum is, and few groups' are.
        bound = np.partition(maxima, GROUPS - top)[GROUPS - top]
        reach = np.flatnonzero(maxima >= bound)
        members = (reach[:, None] + GROUPS * np.arange(lines)).ravel()
        ids = np.concatenate([members[row[members] >= bound], ids])
    values = row[ids]
    order = np.lexsort((ids, -values))[:top]       # best first, equal logits by token id
    return TokenLogprob(token, logprob,
                        tuple((int(ids[i]), float(values[i]) - norm) for i in order))


_scratch = threading.local()


def _exp_sum(row: np.ndarray, best: float) -> float:
    """The sum of exp(row - best): float32 exponentials, summed pairwise (numpy's float32 sum),
    which keeps a log-probability within about 1e-6 of float64's at a third of its time. With
    the best logit in DIRECT's range the exponentials are of the logits themselves, scaled
    after the sum: a pass over the row fewer, and float32 neither overflows nor loses a term
    that counts (those that underflow lie DIRECT[0] + 87 nats or more below the best). The
    exponentials go to a buffer this thread keeps: a fresh vocabulary-sized array each token
    costs the memory allocator page faults that more than double the time."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) != len(row):
        buf = _scratch.buf = np.empty(len(row), dtype=np.float32)
    if DIRECT[0] < best < DIRECT[1]:
        np.exp(row, out=buf, casting="unsafe")
        return float(buf.sum()) * math.exp(-best)
    np.subtract(row, best, out=buf, casting="unsafe")
    np.exp(buf, out=buf)
    return float(buf.sum())


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
