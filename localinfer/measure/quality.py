"""Quality, measured: perplexity over a text and, against a reference variant of the same model,
the mean KL divergence and top-1 token agreement.

The method is llama.cpp's `llama-perplexity`: the text is cut into chunks of n_ctx tokens, each
evaluated from an empty cache with its first token replaced by BOS, and only the second half of
each chunk is scored (every scored token then has at least n_ctx/2 tokens of context). Logits are
taken a few dozen positions at a time and reduced at once, so memory stays flat whatever the text
length or vocabulary.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from localinfer.backends import Session
from localinfer.errors import UsageError

PIECE = 64            # positions evaluated (and their logits reduced) at a time
DEFAULT_TEXT = "alice_ch1-3.txt"


def default_text() -> str:
    """Chapters I-III of Alice's Adventures in Wonderland (public domain; see data/SOURCE.md)."""
    return resources.files("localinfer").joinpath("data", DEFAULT_TEXT).read_text("utf-8")


def read_text(path: Path | None) -> str:
    if path is None:
        return default_text()
    try:
        return path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {path}: {e}") from e


@dataclass
class Totals:
    """Running sums over scored positions."""

    nll: float = 0.0
    kl: float = 0.0
    same_top1: int = 0
    count: int = 0


@dataclass(frozen=True)
class EvalResult:
    perplexity: float
    mean_kl: float | None         # nats per token, KL(reference || model)
    top1_agreement: float | None  # share of positions where both models' most likely token agree
    tokens_scored: int
    chunks: int
    n_ctx: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def tokens_for(session: Session, text: str) -> list[int]:
    """The text's tokens as llama-perplexity takes them: BOS first where the model wants one."""
    tokens = session.tokenize(text, special=False)
    if session.add_bos and session.bos_token is not None:
        tokens = [session.bos_token, *tokens]
    return tokens


def evaluate(model: Session, tokens: Sequence[int], *, n_ctx: int, reference: Session | None = None,
             max_chunks: int | None = None,
             progress: Callable[[int, int, float], None] | None = None) -> EvalResult:
    """Perplexity of `model` on `tokens`; with `reference`, also mean KL and top-1 agreement."""
    n_chunks = len(tokens) // n_ctx
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1:
        raise UsageError(f"the text has {len(tokens)} tokens: fewer than one chunk of --ctx {n_ctx}")
    started = time.perf_counter()
    totals = Totals()
    bos = model.bos_token if model.add_bos else None
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        _score_chunk(model, reference, chunk, totals)
        if progress:
            progress(i + 1, n_chunks, math.exp(totals.nll / totals.count))
    with_ref = reference is not None
    return EvalResult(perplexity=math.exp(totals.nll / totals.count),
                      mean_kl=totals.kl / totals.count if with_ref else None,
                      top1_agreement=totals.same_top1 / totals.count if with_ref else None,
                      tokens_scored=totals.count, chunks=n_chunks, n_ctx=n_ctx,
                      seconds=time.perf_counter() - started)


def _score_chunk(model: Session, reference: Session | None, chunk: list[int], totals: Totals) -> None:
    n_ctx = len(chunk)
    first = n_ctx // 2               # the first half only gives context
    model.reset()
    if reference is not None:
        reference.reset()
    # Every piece asks for all logits, the context half too: llama.cpp's results depend slightly
    # on how a batch is shaped, and this shape reproduces llama-perplexity's figures exactly.
    for start in range(0, n_ctx, PIECE):
        piece = chunk[start:start + PIECE]
        # Two engine views, one per context: both stay valid until that session's next eval.
        logits = model.eval(piece, logits="all")
        ref_logits = reference.eval(piece, logits="all") if reference is not None else None
        lo, hi = max(first, start) - start, min(n_ctx - 1, start + len(piece)) - start
        if lo >= hi:
            continue
        targets = np.asarray(chunk[start + lo + 1:start + hi + 1])
        log_p = log_softmax(logits[lo:hi])
        totals.nll -= float(log_p[np.arange(len(targets)), targets].sum(dtype=np.float64))
        totals.count += len(targets)
        if ref_logits is not None:
            log_q = log_softmax(ref_logits[lo:hi])
            totals.kl += float(kl_rows(log_q, log_p).sum(dtype=np.float64))
            totals.same_top1 += int((log_p.argmax(axis=1) == log_q.argmax(axis=1)).sum())


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities, in float32 with the max subtracted (sums in float64)."""
    shifted = rows.astype(np.float32) - rows.max(axis=1, keepdims=True)
    norm = np.log(np.exp(shifted).sum(axis=1, dtype=np.float64, keepdims=True)).astype(np.float32)
    return shifted - norm


def kl_rows(log_ref: np.ndarray, log_model: np.ndarray) -> np.ndarray:
    """KL(reference || model) per row, in nats."""
    return (np.exp(log_ref) * (log_ref - log_model)).sum(axis=1, dtype=np.float64)
