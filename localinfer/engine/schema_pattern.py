"""A JSON schema's "pattern", rewritten so that the converter's grammar writes valid JSON.

The converter copies a pattern's characters into the JSON string as they are: a quote, a
backslash or a control character came out raw (invalid JSON), `.` and `[^...]` let them through,
and a quantifier's count was expanded without bound. Here every character class (`.` too) is
narrowed to what a JSON string holds unescaped, plus `\\"` and `\\\\` for a quote and a backslash;
every other character that JSON escapes is written as its escape; counts are bounded, and the
size of the expansion (nested counts multiply) is returned for the schema's budget.
"""

from __future__ import annotations

import json
import re

MAX_REPEAT = 1000
MAX_CODE = 0x10FFFF
Ranges = list[tuple[int, int]]              # sorted, disjoint, inclusive code point ranges
# Characters a JSON string cannot hold unescaped, and the surrogates UTF-8 cannot hold.
_UNSAFE: Ranges = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0xD800, 0xDFFF)]
_ESCAPED = [(0x22, 0x22), (0x5C, 0x5C)]    # a quote and a backslash: written as \" and \\
_SHORTHAND = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
              "s": [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x2028, 0x2029), (0xFEFF, 0xFEFF)]}
_CONTROL_ESCAPES = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "0": 0}
_META = set("[](){}*+?|.^$\\/-")
# Kept as they are: the converter's own literal handling is safe for these.
_COUNT = re.compile(r"\{ *([0-9]+) *(?:(,) *([0-9]*) *)?\}")
_PLAIN = set("!#%&',:;<=>@_`~ -/") | {chr(c) for c in range(0x30, 0x7B) if chr(c).isalnum()}


class PatternError(ValueError):
    """What is wrong with a pattern, in words that quote none of it."""


def json_safe_pattern(pattern: str) -> tuple[str, int]:
    """The pattern rewritten for the converter, and the size of its expansion (elements)."""
    if not (pattern.startswith("^") and pattern.endswith("$")) or len(pattern) < 2:
        raise PatternError('it must start with "^" and end with "$"')
    return _Rewriter(pattern[1:-1]).run()


class _Rewriter:
    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0
        self.out: list[str] = []
        self.frames: list[list[int]] = [[]]      # sizes of the units in each open group

    def run(self) -> tuple[str, int]:
        while self.i < len(self.text):
            self._step(self.text[self.i])
        if len(self.frames) > 1:
            raise PatternError("a group is not closed")
        return "^" + "".join(self.out) + "$", sum(self.frames[0])

    def _step(self, c: str) -> None:
        self.i += 1
        if c == "(":
            if self.text.startswith("?", self.i):
                raise PatternError('"(?" groups are not supported')
            self.out.append("(")
            self.frames.append([])
        elif c == ")":
            if len(self.frames) == 1:
                raise PatternError("a group closes that was not opened")
            inner = self.frames.pop()
            self.out.append(")")
            self.frames[-1].append(max(1, sum(inner)))
        elif c == "|":
            self.out.append("|")
        elif c in "*+?":
            self._last("a quantifier")
            self.out.append(c)
        elif c == "{":
            self._count()
        elif c == "[":
            self._unit(_class_text(self._class()))
        elif c == ".":
            self._unit(_class_text(_complement([(0x0A, 0x0A), (0x0D, 0x0D)])))
        elif c == "\\":
            self._escape()
        elif c in "^$":
            raise PatternError(f'"{c}" is supported only at the very start or end')
        else:
            self._unit(_literal(ord(c)))

    def _unit(self, regex: str, size: int = 1) -> None:
        self.out.append(regex)
        self.frames[-1].append(size)

    def _last(self, what: str) -> None:
        if not self.frames[-1] or self.out[-1] in ("(", "|"):
            raise PatternError(f"{what} follows nothing")

    def _count(self) -> None:
        found = _COUNT.match(self.text, self.i - 1)
        if not found:
            raise PatternError("a {m,n} quantifier is malformed")
        self.i = found.end()
        low_text, comma, high_text = found.groups()
        if max(len(low_text), len(high_text or "")) > 6:
            raise PatternError(f"a repetition count is over {MAX_REPEAT}")
        low = int(low_text)
        high = int(high_text) if high_text else None if comma else low
        if max(low, high or 0) > MAX_REPEAT:
            raise PatternError(f"a repetition count is over {MAX_REPEAT}")
        if high is not None and low > high:
            raise PatternError("a {m,n} quantifier has m larger than n")
        self._last("a quantifier")
        self.frames[-1][-1] *= max(1, high if high is not None else low + 1)
        self.out.append("{%d%s}" % (low, "" if not comma else f",{'' if high is None else high}"))

    def _escape(self) -> None:
        code, ranges = self._escaped()
        self._unit(_class_text(ranges) if ranges is not None else _literal(code))

    def _escaped(self) -> tuple[int, Ranges | None]:
        """The escape at self.i (after its backslash): a character, or a class for \\d \\w \\s."""
        if self.i >= len(self.text):
            raise PatternError("it ends with a lone backslash")
        c = self.text[self.i]
        self.i += 1
        if c in _SHORTHAND:
            return 0, _SHORTHAND[c]
        if c in _CONTROL_ESCAPES:
            return _CONTROL_ESCAPES[c], None
        if c in "xu":
            digits = 2 if c == "x" else 4
            hex_ = self.text[self.i:self.i + digits]
            if len(hex_) != digits or any(h not in "0123456789abcdefABCDEF" for h in hex_):
                raise PatternError(f"\\{c} needs {digits} hex digits")
            self.i += digits
            return int(hex_, 16), None
        if c in _META or not c.isalnum():
            return ord(c), None
        raise PatternError(f"the escape \\{c} is not supported")

    def _class(self) -> Ranges:
        """The [...] class at self.i (after its "["), as ranges of code points."""
        negated = self.text.startswith("^", self.i)
        self.i += negated
        ranges: Ranges = []
        while True:
            if self.i >= len(self.text):
                raise PatternError("a [ class is not closed")
            c = self.text[self.i]
            if c == "]":
                self.i += 1
                return _complement(ranges) if negated else _union(ranges)
            low, shorthand = self._class_char()
            if shorthand is not None:
                ranges += shorthand
                continue
            high = low
            if self.text.startswith("-", self.i) and \
                    self.text[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                high, shorthand = self._class_char()
                if shorthand is not None or high < low:
                    raise PatternError("a class range is out of order")
            ranges.append((low, high))

    def _class_char(self) -> tuple[int, Ranges | None]:
        c = self.text[self.i]
        self.i += 1
        if c != "\\":
            return ord(c), None
        if self.text.startswith("b", self.i):       # backspace, inside a class
            self.i += 1
            return 8, None
        return self._escaped()


def _literal(code: int) -> str:
    """One character as the converter should get it: plain, or in a group of its own (a
    quantifier after it then repeats all of it) holding its JSON escape."""
    c = chr(code)
    if c in _PLAIN or (code > 0x7F and not 0xD800 <= code <= 0xDFFF):
        return c
    if 0xD800 <= code <= 0xDFFF:
        raise PatternError("it names a surrogate code point, which UTF-8 cannot hold")
    if code < 0x20 or c in '"\\':
        return "(" + json.dumps(c)[1:-1].replace("\\", "\\\\") + ")"
    return "(" + _class_char_text(code) + ")"


def _class_text(ranges: Ranges) -> str:
    """A class of these characters in the converter's syntax (which GBNF reads as it is)."""
    safe = _subtract(ranges, _UNSAFE)
    escaped = _intersect(ranges, _ESCAPED)
    if not safe and not escaped:
        raise PatternError("a character class matches no character a JSON string can hold")
    parts = []
    if safe:
        parts.append("[" + "".join(_class_char_text(lo) + (
            "" if lo == hi else "-" + _class_char_text(hi)) for lo, hi in safe) + "]")
    if escaped:
        parts.append("\\\\[" + "".join(_class_char_text(lo) for lo, _ in escaped) + "]")
    # An escape is two characters: grouped, a quantifier after the class repeats all of it.
    return parts[0] if not escaped else "(" + "|".join(parts) + ")"


def _class_char_text(code: int) -> str:
    if chr(code).isascii() and chr(code).isalnum():
        return chr(code)
    return f"\\x{code:02X}" if code <= 0xFF else f"\\u{code:04X}" if code <= 0xFFFF \
        else f"\\U{code:08X}"


def _union(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in _union(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE:
        out.append((start, MAX_CODE))
    return out


def _subtract(ranges: Ranges, removed: Ranges) -> Ranges:
    return _intersect(ranges, _complement(removed))


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    out = []
    for lo, hi in _union(a):
        for lo2, hi2 in _union(b):
            if max(lo, lo2) <= min(hi, hi2):
                out.append((max(lo, lo2), min(hi, hi2)))
    return out
