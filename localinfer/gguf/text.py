"""Text from a GGUF file, which is outside input: a string value need not be UTF-8.

A name or a description is only shown, so its bad bytes become U+FFFD and nothing more is said. A
chat template is run: a template whose bytes are not UTF-8 is a damaged one, and running the
replacement characters in its place would prompt the model with text its author never wrote. Such
a template is kept as `Undecoded` text, which shows as the replaced text does and carries the one
line that refuses it wherever it would be rendered (engine/templates.py).
"""

from __future__ import annotations


class Undecoded(str):
    """Text that was not UTF-8, bad bytes shown as U+FFFD; `problem` says where and what."""

    problem: str

    def __new__(cls, text: str, problem: str) -> Undecoded:
        made = super().__new__(cls, text)
        made.problem = problem
        return made


def decoded(data: bytes, what: str) -> str:
    """`data` as text: a plain string when it is UTF-8, else Undecoded text naming `what` (a
    chat template of a file, as a message says it) and the first bad byte, counted from 1."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return Undecoded(data.decode("utf-8", "replace"),
                         f"{what} is not UTF-8 text (byte {e.start + 1})")
