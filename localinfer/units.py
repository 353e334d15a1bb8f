"""Byte sizes as people write them (4GB, 512M, 1.5 GiB) and as localinfer prints them; durations as
Ollama reads them (5m, 1h30m, 300)."""

from __future__ import annotations

import math
import re
import time

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


def ago(when: float) -> str:
    """How long ago the time.time() `when` was, in its largest whole unit ("3 min ago")."""
    seconds = max(0.0, time.time() - when)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def counted(n: int, singular: str, plural: str | None = None) -> str:
    """'1 entry', '2 entries', '1,024 tokens': a count with its noun agreeing."""
    return f"{n:,} {singular if n == 1 else plural or singular + 's'}"


# Go's time.ParseDuration, which Ollama's keep_alive goes through: a sign, then number-unit pairs.
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0,
                   "m": 60.0, "h": 3600.0}
_PART = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)"
_DURATION = re.compile(rf"([+-]?)((?:{_PART})+)")
_SECONDS = re.compile(r"[+-]?(\d+(?:\.\d*)?|\.\d+)")


# The longest duration a duration may say: Go's (2**63 - 1 ns, about 292 years), the longest an
# Ollama client can mean and what Ollama itself keeps a model "for ever" with.
MAX_DURATION_SECONDS = (2 ** 63 - 1) / 1e9
# A duration's text is short: a longer one is refused before any pattern reads it.
MAX_DURATION_CHARS = 64


def parse_duration(value: str | int | float, source: str) -> float:
    """A keep-alive as Ollama reads it, in seconds: a number of seconds (300, "300"), or a Go
    duration ("5m", "1h30m", "1.5h", "0"); any negative value, and any past Go's longest
    duration (MAX_DURATION_SECONDS), means forever (math.inf), so every finite answer is one a
    timer can wait for. `source` names the option or field it came from, for the message."""
    seconds = _seconds(value, source)
    if seconds < 0 or seconds >= MAX_DURATION_SECONDS:
        return math.inf
    return seconds


def _seconds(value, source: str) -> float:
    """The value's seconds, finite and of any sign; a UsageError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        # compared before any float(): an integer of thousands of digits is still a number
        return float(max(min(value, 2 * MAX_DURATION_SECONDS), -1))
    if isinstance(value, float):
        seconds = value
    elif not isinstance(value, str) or len(value) > MAX_DURATION_CHARS:
        seconds = None
    elif _SECONDS.fullmatch(text := value.strip()):
        seconds = float(text)
    elif match := _DURATION.fullmatch(value.strip()):
        sign, parts = match.group(1), re.findall(_PART, match.group(2))
        seconds = sum(float(n) * _DURATION_UNITS[unit] for n, unit in parts)
        seconds = -seconds if sign == "-" else seconds
    else:
        seconds = None
    shown = _shown(value)
    if seconds is None:
        raise UsageError(f"{source}={shown} is not a duration; write e.g. 5m, 1h30m, 300 "
                         "(seconds), 0 (unload when done) or -1 (keep loaded)")
    if not math.isfinite(seconds):
        raise UsageError(f"{source}={shown} is not a finite duration; -1 keeps the model loaded")
    return seconds


def _shown(value) -> str:
    """The value as a message quotes it, cut short: a request may send megabytes of it."""
    if isinstance(value, str) and len(value) > MAX_DURATION_CHARS:
        return f"{value[:MAX_DURATION_CHARS]!r}... ({len(value):,} characters)"
    return repr(value)
