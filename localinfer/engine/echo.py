"""The log-probabilities of a prompt's own tokens: what `echo` with `logprobs` returns on
/v1/completions, and what lm-evaluation-harness scores multiple-choice answers with.

Each token of the prompt but the first is scored under the logits the model gives after the
tokens before it (engine/logprobs.py: the log-softmax of the raw logits); the first has no
context and no figure (None), as OpenAI gives it. The prompt is evaluated in one KV sequence of a
BatchSession, a piece of at most PIECE tokens per llama_decode, each token a piece of its own so
that every position's logits come back (llama.cpp returns one row per output, and a context is
made for at most that many outputs per decode); the sequence is emptied again afterwards, whatever
happens. The caller (server/worker.py) picks a sequence no request uses and a moment between two
scheduler steps, so the cells it takes are back before the next step.
"""

from __future__ import annotations

from typing import Sequence

from localinfer.backends import BatchSession, Piece
from localinfer.engine.logprobs import TokenLogprob, token_logprob

PIECE = 64          # positions whose logits one decode returns (llama/session.py's MAX_OUTPUTS)
# llama.cpp keeps an output buffer as large as the most rows of logits a decode asked for, and
# never shrinks it: the fit counts one row per sequence, so more rows are asked for only up to
# this many bytes (SmolLM2 gets all 64, Gemma 3's 262,144-token rows 16)
LOGITS_BYTES = 16 << 20


def prompt_logprobs(batch: BatchSession, seq: int, tokens: Sequence[int],
                    top: int = 0) -> list[TokenLogprob | None]:
    """One entry per token of `tokens`: None for the first, then each token's log-probability
    after the ones before it, with the `top` likeliest tokens' at that position."""
    scored: list[TokenLogprob | None] = [None]
    most = max(batch.n_seq, LOGITS_BYTES // (4 * batch.session.n_vocab))
    step = max(1, min(PIECE, batch.n_batch, most))
    try:
        # The last token's own logits score nothing here (a generation's first token has its own)
        for start in range(0, len(tokens) - 1, step):
            chunk = tokens[start:min(start + step, len(tokens) - 1)]
            rows = batch.decode([Piece(seq, [token], start + i) for i, token in enumerate(chunk)])
            for i, row in enumerate(rows):
                scored.append(token_logprob(row, tokens[start + i + 1], top))
    finally:
        batch.forget(seq)
    return scored
