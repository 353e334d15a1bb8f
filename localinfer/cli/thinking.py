"""A thinking model's output on the terminal: the answer to stdout, the trace to stderr (dimmed)
or nowhere, and the one line that says why an answer never came."""

from __future__ import annotations

import os
import sys

from localinfer.cli import console
from localinfer.thinking.split import ANSWER, splitter

_DIM, _RESET = "\x1b[2m", "\x1b[0m"


def show_by_default(choice: bool | None) -> bool:
    """--show-thinking/--hide-thinking, else: shown when the answer goes to a terminal (someone
    reads along), dropped in a pipeline."""
    return console.interactive(sys.stdout) if choice is None else choice


class Output:
    """Feeds generated pieces through the model's splitter (none: all answer) and writes each
    part where it goes; keeps both parts' text."""

    def __init__(self, style, *, show_trace: bool, stream: bool = True, answer=None) -> None:
        self.cut = splitter(style) if style is not None else None
        self.show_trace, self.stream = show_trace, stream
        self.write_answer = answer or _stdout
        self.answer_parts: list[str] = []
        self.trace_parts: list[str] = []
        self._dim = show_trace and console.interactive(sys.stderr) and not os.environ.get("NO_COLOR")
        self._trace_open = False

    def feed(self, piece: str) -> None:
        if self.cut is None:
            self._answer(piece)
            return
        for part in self.cut.feed(piece):
            self._answer(part.text) if part.kind == ANSWER else self._trace(part.text)

    def flush(self) -> None:
        if self.cut is not None:
            for part in self.cut.flush():
                self._answer(part.text) if part.kind == ANSWER else self._trace(part.text)
        self._end_trace()

    @property
    def answer(self) -> str:
        return "".join(self.answer_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.trace_parts)

    @property
    def thinking(self) -> bool:
        return self.cut is not None

    def still_thinking(self) -> bool:
        """Whether the output ended inside the trace, before any answer."""
        return self.cut is not None and self.cut.in_trace

    def _answer(self, text: str) -> None:
        self._end_trace()
        self.answer_parts.append(text)
        if self.stream:
            self.write_answer(text)

    def _trace(self, text: str) -> None:
        self.trace_parts.append(text)
        if not self.show_trace:
            return
        self._trace_open = True
        sys.stderr.write(f"{_DIM}{text}{_RESET}" if self._dim else text)
        sys.stderr.flush()

    def _end_trace(self) -> None:
        if self._trace_open:          # the answer starts on a line of its own
            sys.stderr.write("\n\n")
            sys.stderr.flush()
            self._trace_open = False


def _stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
