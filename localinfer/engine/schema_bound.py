"""The most tokens an answer under a grammar can take, so that a constrained answer asked for with
no -n still has a bound (engine/structured.py).

The count is read from the GBNF text llama.cpp runs (a schema's, after conversion, or a --grammar
file's): the longest text each rule can produce, in bytes, where a `<token>` element counts one.
Every token the grammar sampler accepts spells at least one byte of that text (llama.cpp refuses
tokens with an empty piece), so the count bounds the answer's tokens. A rule that can repeat
without end (`*`, `+`, `{m,}`) or refers back to itself has no bound: None.

llama.cpp's parser has already accepted the grammar when this runs (structured.from_* check it
first), so the syntax is taken as it reads it (grammar-parser.cpp); anything unexpected gives
None, which only means the default bound applies.
"""

from __future__ import annotations

import re
from functools import lru_cache

_WORD = re.compile(r"[a-zA-Z0-9-]+")
_COUNT = re.compile(r"\{\s*([0-9]+)\s*(?:(,)\s*([0-9]*)\s*)?\}")
_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]"}
_HEX = {"x": 2, "u": 4, "U": 8}
INFINITE = -1         # a length with no bound, while the rules are summed


class _Unbounded(Exception):
    pass


@lru_cache(maxsize=64)
def longest_answer(gbnf: str) -> int | None:
    """The most tokens an answer that keeps to `gbnf` can take, or None when it has no bound."""
    try:
        rules = _Parser(gbnf).rules()
        return _Lengths(rules).of("root")
    except (_Unbounded, RecursionError, ValueError, IndexError, KeyError):
        return None


def _utf8_len(code: int) -> int:
    return 1 if code < 0x80 else 2 if code < 0x800 else 3 if code < 0x10000 else 4


# A sequence is a list of (element, lowest count, highest count or INFINITE); an element is
# ("text", bytes), ("rule", name) or ("group", [alternative sequences]).
class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def rules(self) -> dict[str, list]:
        found: dict[str, list] = {}
        self._space(newlines=True)
        while self.i < len(self.text):
            name = self._name()
            self._space()
            if not self.text.startswith("::=", self.i):
                raise ValueError("expecting ::=")
            self.i += 3
            self._space(newlines=True)
            found[name] = self._alternatives(nested=False)
            self._space(newlines=True)
        return found

    def _space(self, newlines: bool = False) -> None:
        text = self.text
        while self.i < len(text):
            c = text[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            elif c == "#":
                end = text.find("\n", self.i)
                self.i = len(text) if end < 0 else end
            else:
                return

    def _name(self) -> str:
        match = _WORD.match(self.text, self.i)
        if not match:
            raise ValueError("expecting a name")
        self.i = match.end()
        return match.group()

    def _alternatives(self, nested: bool) -> list:
        options = [self._sequence(nested)]
        while self.i < len(self.text) and self.text[self.i] == "|":
            self.i += 1
            self._space(newlines=True)
            options.append(self._sequence(nested))
        return options

    def _sequence(self, nested: bool) -> list:
        seq: list = []
        text = self.text
        while self.i < len(text):
            c = text[self.i]
            if c == '"':
                self.i += 1
                size = 0
                while text[self.i] != '"':
                    size += self._char()
                self.i += 1
                seq.append([("text", size), 1, 1])
            elif c == "[":
                seq.append([("text", self._class()), 1, 1])
            elif c == ".":
                self.i += 1
                seq.append([("text", 4), 1, 1])
            elif c == "(":
                self.i += 1
                self._space(newlines=True)
                group = self._alternatives(nested=True)
                if text[self.i] != ")":
                    raise ValueError("expecting )")
                self.i += 1
                seq.append([("group", group), 1, 1])
            elif c in "!<":
                end = text.index(">", self.i)
                self.i = end + 1
                seq.append([("text", 1), 1, 1])        # one token, whatever it spells
            elif _WORD.match(c):
                seq.append([("rule", self._name()), 1, 1])
            elif c in "*+?{" and seq:
                self._repeat(seq[-1])
            else:
                break
            self._space(newlines=nested)
        return seq

    def _repeat(self, item: list) -> None:
        c = self.text[self.i]
        if c != "{":
            self.i += 1
            low, high = {"*": (0, INFINITE), "+": (1, INFINITE), "?": (0, 1)}[c]
        else:
            match = _COUNT.match(self.text, self.i)
            if not match:
                raise ValueError("expecting a count")
            self.i = match.end()
            low = int(match.group(1))
            high = low if not match.group(2) else \
                int(match.group(3)) if match.group(3) else INFINITE
        # A repeated repetition: the counts multiply (llama.cpp wraps the first in a rule).
        item[1] *= low
        item[2] = INFINITE if INFINITE in (item[2], high) else item[2] * high

    def _char(self) -> int:
        """The UTF-8 length of the literal's or class's next character, consumed."""
        text = self.text
        c = text[self.i]
        if c != "\\":
            self.i += 1
            return _utf8_len(ord(c))
        kind = text[self.i + 1]
        if kind in _HEX:
            digits = text[self.i + 2:self.i + 2 + _HEX[kind]]
            self.i += 2 + _HEX[kind]
            return min(4, _utf8_len(int(digits, 16)))
        self.i += 2
        return _utf8_len(ord(_ESCAPES[kind]))

    def _class(self) -> int:
        """The longest character a class can match, in bytes; the class consumed."""
        text = self.text
        self.i += 1
        negated = text[self.i] == "^"
        self.i += negated
        most = 1
        while text[self.i] != "]":
            most = max(most, self._char())
            if text[self.i] == "-" and text[self.i + 1] != "]":
                self.i += 1
                most = max(most, self._char())
        self.i += 1
        return 4 if negated else most


class _Lengths:
    """Each rule's longest text; a rule met again while it is being summed has no bound."""

    def __init__(self, rules: dict[str, list]) -> None:
        self.rules = rules
        self.known: dict[str, int] = {}
        self.open: set[str] = set()

    def of(self, name: str) -> int:
        if name in self.known:
            return self.known[name]
        if name in self.open or name not in self.rules:
            raise _Unbounded(name)
        self.open.add(name)
        value = self._alternatives(self.rules[name])
        self.open.discard(name)
        self.known[name] = value
        return value

    def _alternatives(self, options: list) -> int:
        return max(self._sequence(seq) for seq in options)

    def _sequence(self, seq: list) -> int:
        total = 0
        for (kind, value), _, high in seq:
            size = value if kind == "text" else self.of(value) if kind == "rule" \
                else self._alternatives(value)
            if size and high == INFINITE:
                raise _Unbounded(kind)
            total += size * high
        return total
