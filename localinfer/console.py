"""Terminal output: what goes to stderr, and whether colour and progress bars are allowed there."""

from __future__ import annotations

import sys
from functools import lru_cache

from rich.console import Console

from localinfer import settings


@lru_cache(maxsize=1)
def stderr() -> Console:
    """Rich console on stderr: plain text when stderr is not a terminal or NO_COLOR is set."""
    return Console(stderr=True, no_color=settings.load().no_color, highlight=False,
                   soft_wrap=True)


def interactive(stream=None) -> bool:
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def note(message: str) -> None:
    """A dim line on stderr for progress and hints."""
    stderr().print(message, style="dim", markup=False)


def warn(message: str) -> None:
    stderr().print(f"localinfer: warning: {message}", style="yellow", markup=False)


def error(message: str) -> None:
    stderr().print(f"localinfer: error: {message}", style="bold red", markup=False)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """Aligned plain-text columns on stdout: readable on a terminal, easy to cut in a pipe."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    for row in [headers, *rows]:
        line = "  ".join(str(c).ljust(w) for c, w in zip(row, widths))
        sys.stdout.write(line.rstrip() + "\n")


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
