"""Log-probabilities (engine/logprobs.py) in the shapes each API gives them, and which of them
belong to the text a stream has sent so far.

A token's `token` is its piece decoded as UTF-8 (a piece that ends inside a character shows the
replacement character; its `bytes` are the piece's raw bytes, so a character split across
tokens is whole again when a client joins the bytes); a control token, whose piece is empty, shows
its text in the vocabulary. A figure that is not a number (a broken row of logits) is null, and
minus infinity (a token the model rules out) is OpenAI's -9999.0: JSON has neither.
"""

from __future__ import annotations

import codecs
import math
from typing import Sequence

from localinfer.engine.logprobs import TokenLogprob

NEVER = -9999.0         # OpenAI's figure for a token with no probability


def raw(session, token: int) -> bytes:
    """The bytes a token stands for: its piece, or a control token's text."""
    return session.piece(token) or session.token_text(token).encode()


def text_of(session, token: int) -> str:
    return raw(session, token).decode("utf-8", "replace")


def figure(logprob: float) -> float | None:
    if math.isnan(logprob):
        return None
    return logprob if math.isfinite(logprob) else NEVER


def _one(session, token: int, logprob: float) -> dict:
    return {"token": text_of(session, token), "logprob": figure(logprob),
            "bytes": list(raw(session, token))}


def entry(session, scored: TokenLogprob) -> dict:
    """OpenAI's chat (and the Responses API's, and Ollama's) entry for one token."""
    return {**_one(session, scored.token, scored.logprob),
            "top_logprobs": [_one(session, t, lp) for t, lp in scored.top]}


def entries(session, scored: Sequence[TokenLogprob]) -> list[dict]:
    return [entry(session, s) for s in scored]


def legacy(session, tokens: Sequence[int], scored: Sequence[TokenLogprob | None],
           offset: int = 0) -> dict:
    """/v1/completions' object: each token's text, log-probability (null where there is none:
    an echoed prompt's first token), its top alternatives as {text: logprob} with the chosen
    token's own among them (OpenAI's "up to logprobs + 1"), and where its text starts in the
    choice's text (from `offset`)."""
    texts, figures, tops, offsets = [], [], [], []
    for token, s, start in zip(tokens, scored, starts(session, tokens, offset)):
        texts.append(text_of(session, token))
        offsets.append(start)
        if s is None:
            figures.append(None)
            tops.append(None)
            continue
        figures.append(figure(s.logprob))
        top = {}
        for t, lp in s.top:
            top.setdefault(text_of(session, t), figure(lp))
        top.setdefault(texts[-1], figure(s.logprob))
        tops.append(top)
    return {"tokens": texts, "token_logprobs": figures, "top_logprobs": tops,
            "text_offset": offsets}


def decoded(session, tokens: Sequence[int]) -> str:
    """The tokens' text, as the offsets count it."""
    return b"".join(raw(session, t) for t in tokens).decode("utf-8", "replace")


def starts(session, tokens: Sequence[int], offset: int = 0) -> list[int]:
    """Where each token's text starts in the text of all of them (characters, from offset)."""
    follow = _Ends(session)
    out = []
    for token in tokens:
        out.append(offset + follow.chars)
        follow.add(token)
    return out


class _Ends:
    """Characters of text through each token, a character split across tokens counted with
    the token that begins it."""

    def __init__(self, session) -> None:
        self.session = session
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0          # whole characters so far

    def add(self, token: int) -> int:
        """The end of `token`'s text (one more where it begins a character not yet whole)."""
        self.chars += len(self._utf8.decode(raw(self.session, token)))
        return self.chars + (1 if self._utf8.getstate()[0] else 0)


class Following:
    """Which of a running job's scored tokens the text sent so far holds: a stream hands each
    chunk the entries of the tokens whose text it carries, each entry once."""

    def __init__(self, session, job) -> None:
        self.job, self._ends = job, _Ends(session)
        self.ends: list[int] = []       # chars through each token
        self.given = 0                  # entries handed out

    def upto(self, sent: int) -> list[TokenLogprob]:
        """Entries not handed out yet of the tokens whose text lies within `sent` characters."""
        job = self.job
        # The scheduler's thread appends the token, then its figure: count what has both
        known = min(len(job.tokens), len(job.logprobs))
        while len(self.ends) < known:
            self.ends.append(self._ends.add(job.tokens[len(self.ends)]))
        start = self.given
        while self.given < known and self.ends[self.given] <= sent:
            self.given += 1
        return job.logprobs[start:self.given]

    def rest(self) -> list[TokenLogprob]:
        """Once the job is done: the entries left of the tokens whose text the answer shows (a
        stop string's own tokens are not part of it)."""
        self.upto(0)
        shown = len(self.job.text)
        start = self.given
        while self.given < len(self.ends) and \
                (self.ends[self.given - 1] if self.given else 0) < shown:
            self.given += 1
        return self.job.logprobs[start:self.given]


def shown(session, job) -> list[TokenLogprob]:
    """A finished job's entries of the tokens its text shows."""
    return Following(session, job).rest()
