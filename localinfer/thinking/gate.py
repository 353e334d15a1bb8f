"""A grammar over a thinking model's whole output: the trace is free, the answer keeps to the
user's grammar (--json-schema, --grammar), and a spent `--think-budget` writes the close marker.

It stands where the decode loop takes a grammar, so plain and speculative decoding both go
through it: each choice it allows depends only on the tokens accepted before, which keeps greedy
speculation token-for-token exact across the trace's end.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import numpy as np

from localinfer.backends import Grammar
from localinfer.thinking.split import ANSWER, REASONING, HarmonySplitter, TagSplitter, splitter
from localinfer.thinking.style import Style


class TraceGate:
    """`answer`: the grammar the answer keeps to (None: any text); `budget`: trace tokens before
    the close (None: no limit); `close`: the tokens that end the trace; `opening`: the tokens
    that open it, allowed before the answer starts; `text_of`: a token's text, control markers
    included."""

    def __init__(self, style: Style, text_of: Callable[[int], str], *, close: Sequence[int],
                 opening: Sequence[int] = (), budget: int | None = None,
                 answer: Grammar | None = None) -> None:
        self.text_of, self.closing, self.opening = text_of, list(close), list(opening)
        self.budget, self.answer = budget, answer
        self.cut = splitter(style)
        self.spent = 0                # trace tokens written
        self.forced = -1              # index into `close` while it is written, else -1
        self.answer_began = False     # a token went to the answer's grammar
        self.opened = 0               # tokens of `opening` written at the very start
        if budget == 0 and self._phase() == "trace":    # the prompt opened it: close at once
            self.forced = 0

    # -- the phase, as the splitter tells it -------------------------------------------------
    def _phase(self) -> str:
        cut = self.cut
        if isinstance(cut, TagSplitter):
            return {"start": "start", "trace-start": "trace", "trace": "trace"}.get(cut.phase,
                                                                                   ANSWER)
        assert isinstance(cut, HarmonySplitter)
        if cut.phase != "body":
            return "start"
        return "trace" if cut.kind == REASONING else ANSWER

    def _next_forced(self) -> int | None:
        return self.closing[self.forced] if self.forced >= 0 else None

    # -- Grammar ------------------------------------------------------------------------------
    def allows(self, ids: np.ndarray) -> np.ndarray:
        forced = self._next_forced()
        if forced is not None:
            return ids == forced
        phase = self._phase()
        if self.answer is None or phase == "trace":
            return np.ones(len(ids), dtype=bool)
        ok = self.answer.allows(ids)
        if phase == "start":
            ok = ok | self._opening_allows(ids)
        if not self.answer_began:         # space between the trace and the answer
            ok = ok | np.array([self.text_of(int(t)).isspace() for t in ids], dtype=bool)
        return ok

    def _opening_allows(self, ids: np.ndarray) -> np.ndarray:
        if self.opened < len(self.opening):
            return ids == self.opening[self.opened]
        return np.ones(len(ids), dtype=bool)   # opened whole: the splitter decides next

    def mask(self, logits: np.ndarray) -> np.ndarray:
        forced = self._next_forced()
        phase = self._phase()
        if forced is None and (self.answer is None or phase == "trace"):
            return logits
        if forced is not None:
            row = np.full_like(logits, -np.inf)
            row[forced] = logits[forced]
            return row
        row = self.answer.mask(logits)
        if phase == "start" and self.opened < len(self.opening):
            row[self.opening[self.opened]] = logits[self.opening[self.opened]]
        return row

    def accept(self, token: int) -> None:
        text, before = self.text_of(token), self._phase()
        if self.forced >= 0:
            self.forced = self.forced + 1 if self.forced + 1 < len(self.closing) else -1
            self.cut.feed(text)
            return
        opening = before == "start" and self.opened < len(self.opening) \
            and token == self.opening[self.opened]
        self.opened += opening
        self.cut.feed(text)
        now = self._phase()
        # A harmony header's last token (`<|message|>`) opens the answer but is no part of it:
        # the answer's grammar would refuse it (llama.cpp aborts on a refused token).
        header_end = before == "start" and isinstance(self.cut, HarmonySplitter)
        if now == ANSWER and before != "trace" and not opening and not header_end:
            self._to_answer(token, text)
        self.spent += before == "trace" and now == "trace"
        if now == "trace" and self.budget is not None and self.spent >= self.budget:
            self.forced = 0

    def _to_answer(self, token: int, text: str) -> None:
        if self.answer is None or (not self.answer_began and text.isspace()):
            return
        self.answer.accept(token)
        self.answer_began = True

    def clone(self) -> TraceGate:
        twin = copy.copy(self)
        twin.cut = copy.deepcopy(self.cut)
        twin.answer = self.answer.clone() if self.answer is not None else None
        return twin

    def close(self) -> None:
        if self.answer is not None:
            self.answer.close()
