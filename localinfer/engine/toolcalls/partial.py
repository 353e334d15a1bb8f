"""A call's arguments read as they are decoded, for the streams of serve: a format's `call_head`
finds where the next call's name and arguments begin, and `JsonEcho` writes the arguments' JSON
back piece by piece exactly as `json.dumps(json.loads(whole))` writes it whole (", " and ": "
between items, strings ASCII-escaped, numbers as Python reads them), so that the pieces a client
joins are the arguments a whole reply gives. Only what is written whole is echoed: a string's
characters as each completes (an escape once all of it is there), a number or literal once the
character after it ends it."""

from __future__ import annotations

import json
import re

# What follows a call's name up to its arguments' object, in the formats that write
# {"name": "NAME", "arguments": {...}} (Llama's "parameters"): the name is a tool's (letters,
# digits, _ . -), the arguments an object (a format that writes them as a string is read whole).
NAME = r"([A-Za-z0-9_.\-]{1,64})"
HEAD = r'\{\s*"name"\s*:\s*"' + NAME + r'"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
_NUMBER = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_SHORT = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def head(pattern: re.Pattern, text: str, at: int, *, anchored: bool) -> tuple[str, int] | None:
    """The next call's name and where its arguments begin, by `pattern` (its name the first
    group, its end the arguments' opening brace); `anchored`: only right at `at`."""
    found = pattern.match(text, at) if anchored else pattern.search(text, at)
    return (found.group(1), found.end()) if found else None


def _escaped(char: str) -> str:
    """One character as json.dumps writes it inside a string (ensure_ascii)."""
    return char if " " <= char <= "~" and char not in '"\\' else json.dumps(char)[1:-1]


class JsonEcho:
    """One JSON object's text, given piece by piece, as json.dumps writes it back. `used`: the
    characters read (up to the object's end, once `done`); `broken`: the text is no JSON this
    reads (a grammar keeps it from happening), and nothing more is echoed."""

    def __init__(self) -> None:
        self.stack: list[str] = []      # the containers open
        self.token = ""                 # a number or literal being read
        self.escape: str | None = None  # in a string: the escape being read ("" none)
        self.used, self.done, self.broken = 0, False, False

    def feed(self, text: str) -> str:
        out: list[str] = []
        for char in text:
            if self.done or self.broken:
                break
            self.used += 1
            if self.escape is not None:
                self._in_string(char, out)
            else:
                self._outside(char, out)
        return "".join(out)

    def _in_string(self, char: str, out: list[str]) -> None:
        if self.escape == "":
            if char == '"':
                out.append('"')
                self.escape = None
            elif char == "\\":
                self.escape = "\\"
            elif char < " ":            # a raw control character: json.loads refuses it
                self.broken = True
            else:
                out.append(_escaped(char))
            return
        self.escape += char
        if self.escape[1] != "u":
            if self.escape[1] not in _SHORT:
                self.broken = True
                return
            out.append(_escaped(_SHORT[self.escape[1]]))
            self.escape = ""
        elif len(self.escape) == 6:     # each \\uXXXX alone: a pair is written back as a pair
            try:
                out.append(_escaped(chr(int(self.escape[2:], 16))))
            except ValueError:
                self.broken = True
            self.escape = ""

    def _outside(self, char: str, out: list[str]) -> None:
        if self.token:
            if (char in _NUMBER) if self.token[0] in "-0123456789" else char.isalpha():
                self.token += char
                return
            self._token_end(out)
            if self.broken or self.done:
                self.used -= 1          # the character after the value is not the value's
                return
        if char in " \t\n\r":
            return
        if not self.stack and char != "{":
            self.broken = True
        elif char in "{[":
            self.stack.append(char)
            out.append(char)
        elif char in "}]":
            if self.stack.pop() != "{["["}]".index(char)]:
                self.broken = True
                return
            out.append(char)
            self.done = not self.stack
        elif char in ",:":
            out.append(char + " ")
        elif char == '"':
            out.append('"')
            self.escape = ""
        elif char in "-0123456789" or char in "tfn":
            self.token = char
        else:
            self.broken = True

    def _token_end(self, out: list[str]) -> None:
        token, self.token = self.token, ""
        if token[0].isalpha():
            self.broken = token not in _LITERALS
            out.append(token)
            return
        try:
            value = json.loads(token)
        except ValueError:              # not a number, or one with too many digits to read
            self.broken = True
            return
        out.append(json.dumps(value))
