"""A GBNF grammar's text, checked before llama.cpp's parser sees it.

The parser recurses per nesting level (its stack overflowed, a crash, at 20,000 nested groups),
copies a repeated item once per count (`"<100,000 characters>"{2000}` took 3.6 GB), silently
reads a count over 2,000 as "no limit", and cannot match a NUL character (it reads the text and
each token's piece as C strings): each is refused here with its line and column, never with the
text around it (a grammar file may be anything: /proc/self/environ was echoed).
"""

from __future__ import annotations

import re

from localinfer.engine.schema_pattern import MAX_REPEAT
from localinfer.errors import UsageError

MAX_NESTING = 2_000
# Grammar elements after repetition, counted as if nested counts multiplied (llama.cpp's parser
# makes each group a rule of its own, so what it holds is often less): an upper bound.
MAX_EXPANSION = 1_000_000
_COUNT = re.compile(r"\{[ \t]*([0-9]+)[ \t]*(?:(,)[ \t]*([0-9]*)[ \t]*)?\}")
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.S)
_WORD = re.compile(r"[a-zA-Z0-9-]+")


def check_gbnf(gbnf: str, where: str) -> None:
    """Refuse a grammar whose parse would cost without bound or that can match nothing here."""
    _Scan(gbnf, where).run()


class _Scan:
    def __init__(self, text: str, where: str) -> None:
        self.text, self.where, self.i = text, where, 0
        # Per open group: [its elements so far, the elements of its last unit].
        self.frames: list[list[int]] = [[0, 0]]

    def fail(self, what: str, at: int) -> UsageError:
        line = self.text.count("\n", 0, at) + 1
        column = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return UsageError(f"{self.where}: line {line}, column {column}: {what}")

    def run(self) -> None:
        nul = self.text.find("\0")
        if nul >= 0:
            raise self.fail("a NUL byte (a grammar is text)", nul)
        text = self.text
        while self.i < len(text):
            c, start = text[self.i], self.i
            self.i += 1
            if c == "#":
                end = text.find("\n", self.i)
                self.i = len(text) if end < 0 else end
            elif c == '"':
                self._unit(self._literal(start))
            elif c == "[":
                self._unit(self._class(start))
            elif c == "<":
                end = text.find(">", self.i)
                self.i = len(text) if end < 0 else end + 1
                self._unit(1)
            elif c == "(":
                self.frames.append([0, 0])
                if len(self.frames) > MAX_NESTING + 1:
                    raise UsageError(f"{self.where}: groups nested more than {MAX_NESTING} deep")
            elif c == ")" and len(self.frames) > 1:
                self._unit(max(1, self.frames.pop()[0]))
            elif c == "{":
                self._count(start)
            elif c == "|" or (c == "\n" and len(self.frames) == 1):
                self._unit(0)                    # a quantifier after it has nothing to repeat
            elif _WORD.match(c) or c == ".":
                end = _WORD.match(text, start)
                self.i = end.end() if end else self.i
                self._unit(1)
        if self.frames[0][0] > MAX_EXPANSION:
            raise self._too_large(len(text))

    def _too_large(self, at: int) -> UsageError:
        return self.fail(f"the grammar expands to over {MAX_EXPANSION:,} elements (lower its "
                         "repetition counts)", at)

    def _unit(self, size: int) -> None:
        frame = self.frames[-1]
        frame[0] += size
        frame[1] = size

    def _count(self, start: int) -> None:
        found = _COUNT.match(self.text, start)
        if not found:
            return                               # llama.cpp's parser says what is wrong
        self.i = found.end()
        low, comma, high = found.groups()
        counts = [low] + ([high] if high else [])
        if any(len(n) > 6 or int(n) > MAX_REPEAT for n in counts):
            raise self.fail(f"a repetition count over {MAX_REPEAT}", start)
        times = int(high) if high else int(low) + 1 if comma else int(low)
        frame = self.frames[-1]
        frame[0] += frame[1] * (max(1, times) - 1)
        frame[1] *= max(1, times)
        # A group holds no fewer elements than its parts: one over the bound is refused now.
        if frame[0] > MAX_EXPANSION:
            raise self._too_large(start)

    def _literal(self, start: int) -> int:
        """Skip a "literal" (self.i is after its quote); its size in characters."""
        size = 0
        while self.i < len(self.text) and self.text[self.i] != '"':
            code = self._char(start)
            if code == 0:
                raise self.fail("a NUL character, which llama.cpp's grammar engine cannot "
                                "match", start)
            size += 1
        self.i += 1
        return size

    def _class(self, start: int) -> int:
        """Skip a [class] (self.i is after its bracket); refuse one that matches nothing."""
        negated = self.text.startswith("^", self.i)
        self.i += negated
        members: list[tuple[int, int]] = []
        while self.i < len(self.text) and self.text[self.i] != "]":
            low = high = self._char(start)
            if self.text.startswith("-", self.i) and \
                    self.text[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                high = self._char(start)
            members.append((low, high))
        self.i += 1
        if not _matches_some(members, negated):
            raise self.fail("a character class that matches no character", start)
        return 1 + len(members)

    def _char(self, start: int) -> int:
        """One character of a literal or class at self.i, escapes read as llama.cpp reads them."""
        if self.text[self.i] != "\\":
            self.i += 1
            return ord(self.text[self.i - 1])
        found = _ESCAPE.match(self.text, self.i)
        if not found:
            raise self.fail("a literal or class is not closed", start)
        self.i = found.end()
        body = found.group(1)
        if len(body) > 1:
            return int(body[1:], 16)
        return {"t": 9, "r": 13, "n": 10}.get(body, ord(body))


def _matches_some(members: list[tuple[int, int]], negated: bool) -> bool:
    """Whether a class matches a character other than NUL (which the engine never matches)."""
    if not negated:
        return any(high >= max(low, 1) for low, high in members)
    covered, reach = sorted(members), 1          # the lowest character not yet excluded
    for low, high in covered:
        if low > reach:
            return True
        reach = max(reach, high + 1)
    return reach <= 0x10FFFF
