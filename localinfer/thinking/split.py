"""The generated text cut, as it streams, into the trace and the answer.

A splitter is fed the text pieces of a generation in order and hands back the parts it can tell
apart so far; text that may be the start of a marker (`</th` of `</think>`) is held back until
the next piece settles it, so no marker ever leaks into either part, wherever a piece cuts it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from localinfer.thinking.style import (CALL, CHANNEL, CLOSE, END, HARMONY_MARKERS, MESSAGE, OPEN,
                                       RETURN, START, Style)

REASONING, ANSWER = "reasoning", "answer"
# A harmony header longer than this without `<|message|>` is not a header: the model writes
# plain text, which is then the answer.
_MAX_HEADER = 256


class Part(NamedTuple):
    kind: str       # REASONING or ANSWER
    text: str


class Splitter:
    """What both splitters tell: whether the answer began and whether a trace was written."""

    answered = False
    thought = False

    def feed(self, text: str) -> list[Part]:
        raise NotImplementedError

    def flush(self) -> list[Part]:
        raise NotImplementedError

    def _part(self, kind: str, text: str, parts: list[Part]) -> None:
        if not text:
            return
        if kind == ANSWER:
            self.answered = True
        else:
            self.thought = True
        parts.append(Part(kind, text))


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin one of `markers`."""
    longest = max(map(len, markers)) - 1
    for n in range(min(len(text), longest), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class TagSplitter(Splitter):
    """`<think>TRACE</think>ANSWER`; the trace is recognised only at the start of the output
    (or is already open when the prompt opened it). Whitespace around the trace is dropped."""

    def __init__(self, starts_inside: bool = False) -> None:
        self.phase = "trace-start" if starts_inside else "start"
        self.pending = ""

    @property
    def in_trace(self) -> bool:
        return self.phase in ("trace-start", "trace")

    def feed(self, text: str) -> list[Part]:
        self.pending += text
        parts: list[Part] = []
        while self._step(parts):
            pass
        return parts

    def _step(self, parts: list[Part]) -> bool:
        """One move of the state machine; False when it waits for more text."""
        phase, text = self.phase, self.pending
        if phase in ("start", "trace-start", "answer-start"):
            rest = text.lstrip()
            if not rest:
                self.pending = text if phase == "start" else ""
                return False
            if phase == "start":
                if rest.startswith(OPEN):
                    self.phase, self.pending = "trace-start", rest[len(OPEN):]
                    return True
                if OPEN.startswith(rest):
                    return False
            self.phase, self.pending = ("trace" if phase == "trace-start" else "answer"), rest
            return True
        if phase == "answer":
            self._part(ANSWER, text, parts)
            self.pending = ""
            return False
        at = text.find(CLOSE)
        if at >= 0:
            self._part(REASONING, text[:at].rstrip(), parts)
            self.phase, self.pending = "answer-start", text[at + len(CLOSE):]
            return True
        keep = len(text) - _held(text, (CLOSE,))
        shown = text[:keep].rstrip()          # trailing space may end the trace: held too
        self._part(REASONING, shown, parts)
        self.pending = text[len(shown):]
        return False

    def flush(self) -> list[Part]:
        parts: list[Part] = []
        text, self.pending = self.pending, ""
        if self.phase == "answer":
            self._part(ANSWER, text, parts)
        elif self.in_trace:
            self._part(REASONING, text.rstrip(), parts)
        elif self.phase == "start" and text.strip():     # a lone, unfinished `<thi`
            self._part(ANSWER, text.lstrip(), parts)
        return parts


_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_ENDS = (END, RETURN, CALL)


class HarmonySplitter(Splitter):
    """gpt-oss's messages: `<|start|>assistant<|channel|>NAME<|message|>TEXT<|end|>` in turn;
    `analysis` is the trace, any other channel (final, commentary) the answer. `header` is the
    header the prompt left open (`assistant`), so the output goes on with its channel."""

    def __init__(self, header: str = "") -> None:
        self.phase, self.header, self.pending = "header", header, ""
        self.kind = ANSWER

    @property
    def in_trace(self) -> bool:
        return self.thought and not self.answered

    def feed(self, text: str) -> list[Part]:
        self.pending += text
        parts: list[Part] = []
        while getattr(self, "_" + self.phase)(parts):
            pass
        return parts

    def _header(self, parts: list[Part]) -> bool:
        at = self.pending.find(MESSAGE)
        if at < 0:
            if len(self.header) + len(self.pending) > _MAX_HEADER:   # plain text, no header
                self.pending, self.header = self.header + self.pending, ""
                self.phase, self.kind = "body", ANSWER
                return True
            return False
        header = self.header + self.pending[:at]
        name = _CHANNEL_NAME.search(header)
        self.kind = REASONING if name and name.group(1) == "analysis" else ANSWER
        self.phase, self.header, self.pending = "body", "", self.pending[at + len(MESSAGE):]
        return True

    def _body(self, parts: list[Part]) -> bool:
        ends = [(i, m) for m in _ENDS if (i := self.pending.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self._part(self.kind, self.pending[:at], parts)
            self.phase, self.pending = "between", self.pending[at + len(marker):]
            return True
        keep = len(self.pending) - _held(self.pending, HARMONY_MARKERS)
        self._part(self.kind, self.pending[:keep], parts)
        self.pending = self.pending[keep:]
        return False

    def _between(self, parts: list[Part]) -> bool:
        rest = self.pending.lstrip()
        if rest.startswith(START):
            self.phase, self.pending = "header", rest[len(START):]
            return True
        if START.startswith(rest):
            return False
        self.phase, self.kind, self.pending = "body", ANSWER, rest   # a message without header
        return True

    def flush(self) -> list[Part]:
        parts: list[Part] = []
        text, self.pending = self.pending, ""
        if self.phase == "body":
            self._part(self.kind, text, parts)
        elif self.phase == "header" and CHANNEL not in self.header + text:
            self._part(ANSWER, (self.header + text).strip(), parts)
        return parts


def splitter(style: Style) -> TagSplitter | HarmonySplitter:
    if style.kind == "harmony":
        return HarmonySplitter(style.header)
    return TagSplitter(style.starts_inside)


def split_text(style: Style | None, text: str) -> tuple[str, str]:
    """(trace, answer) of a whole generated text; ("", text) for a model without a trace."""
    if style is None:
        return "", text
    cut = splitter(style)
    parts = cut.feed(text) + cut.flush()
    return ("".join(p.text for p in parts if p.kind == REASONING),
            "".join(p.text for p in parts if p.kind == ANSWER))
