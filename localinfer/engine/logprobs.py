"""Log-probabilities of the tokens a generation emits, and of the likeliest alternatives.

They are the model's own: the log-softmax over the RAW logits row the model produced for that
position, before any repeat, frequency or presence penalty, logit bias, temperature, top-k, top-p
or min-p, and before a grammar's mask. That is what OpenAI and vLLM report by default, and it makes
a token's log-probability a property of the model and the text alone: the same under any sampling
settings, under speculative decoding and in the batch scheduler wherever those give the same logits.

Per token this costs one pass over the vocabulary-sized row (its maximum and a comparison) and the
exponentials of the few logits near the top: a logit more than NEGLIGIBLE nats below the best one
adds less than e^-NEGLIGIBLE each to the partition function, which even over a million tokens
stays far below float64's resolution of the result, so the tail is left out (measured in
docs/logprobs.md against the full log-softmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_TOP = 20          # the most alternatives asked for (OpenAI's top_logprobs bound)
# Logits this many nats under the best are left out of the partition function: their sum is
# below vocabulary × e^-NEGLIGIBLE relative to the best token's term.
NEGLIGIBLE = 40.0


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
    best = float(row.max())
    if not math.isfinite(best):          # a broken row (nan, inf): no figure to give
        return _unscorable(row, token, top)
    near = np.flatnonzero(row >= best - NEGLIGIBLE)
    values = row[near].astype(np.float64)
    norm = best + math.log(float(np.exp(values - best).sum()))
    logprob = float(row[token]) - norm
    if top == 0:
        return TokenLogprob(token, logprob)
    if len(near) < top:                  # a very peaked row: the runners-up lie in the tail
        near = np.argpartition(row, len(row) - top)[len(row) - top:]
        values = row[near].astype(np.float64)
    elif len(near) > top:
        keep = np.argpartition(values, len(values) - top)[len(values) - top:]
        near, values = near[keep], values[keep]
    order = np.lexsort((near, -values))
    return TokenLogprob(token, logprob,
                        tuple((int(near[i]), float(values[i]) - norm) for i in order))


def _unscorable(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """A row with no finite maximum gives nan: the engine produced no distribution here."""
    nan = float("nan")
    return TokenLogprob(token, nan, tuple((int(i), nan) for i in range(min(top, len(row)))))
