"""Byte sizes as people write them (4GB, 512M, 1.5 GiB) and as localinfer prints them."""

from __future__ import annotations

import re

from localinfer.errors import UsageError

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*")


def parse_size(text: str, source: str) -> int:
    """'4GB', '512M', '1.5 GiB', '2000000000' → bytes (K, M, G, T are powers of 1000, KiB and the
    like of 1024); `source` names the option or variable the text came from, for the message."""
    match = _SIZE.fullmatch(text.lower())
    if not match:
        raise UsageError(f"{source}={text!r} is not a size; write e.g. 4GB, 500M, 6GiB or 0")
    number, unit, binary = match.groups()
    power = "bkmgt".index(unit or "b")
    return int(float(number) * (1024 if binary else 1000) ** power)


def human_size(n: float) -> str:
    """Bytes in decimal units with one decimal: '98.6 MB'."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def counted(n: int, singular: str, plural: str | None = None) -> str:
    """'1 entry', '2 entries', '1,024 tokens': a count with its noun agreeing."""
    return f"{n:,} {singular if n == 1 else plural or singular + 's'}"
