"""Terminal output: what goes to stderr, and whether colour and progress bars are allowed there.

rich is imported only when stderr is a terminal: on a pipe every line is plain text anyway, and
the import would cost commands such as `quantize` a few hundredths of a second.
"""

from __future__ import annotations

import contextlib
import json
import sys
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, Iterator

from localinfer import settings

if TYPE_CHECKING:
    from rich.console import Console

# --debug (or LOCALINFER_DEBUG): `app.main` sets it, the commands read it (`options.engine_log`).
# It lives here, below every command module, so that they need not import the app that imports them.
_debug = False


def set_debugging(on: bool) -> None:
    global _debug
    _debug = on


def debugging() -> bool:
    """--debug (or LOCALINFER_DEBUG) was given: tracebacks, and the engine's log."""
    return _debug


@lru_cache(maxsize=1)
def stderr() -> Console:
    """Rich console on stderr: plain text when stderr is not a terminal or NO_COLOR is set."""
    from rich.console import Console
    return Console(stderr=True, no_color=settings.load().no_color, highlight=False,
                   soft_wrap=True)


def clean(text: object, keep: str = "") -> str:
    """Text from outside (a GGUF file, a server, a request) made safe to show on a terminal: each
    character that is not printable (ESC, CR, LF, BEL, C1 controls, bidi overrides, ...) escaped
    as Python writes it (`\\x1b`), save those in `keep`. The result is printable, so cleaning
    it again changes nothing."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def json_text(value: object, **dumps) -> str:
    """JSON with its non-ASCII text kept readable and every character a terminal could act on
    (json leaves C1 controls, DEL and bidi overrides raw) written as its \\u escape: the same
    JSON value."""
    text = json.dumps(value, ensure_ascii=False, **dumps)
    return "".join(c if c.isprintable() or c == "\n" else _json_escape(c) for c in text)


def _json_escape(c: str) -> str:
    code = ord(c)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000                 # beyond the BMP: JSON writes a surrogate pair
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _say(message: str, style: str) -> None:
    message = clean(message)        # names and messages from files and servers are in it
    if interactive():
        stderr().print(message, style=style, markup=False)
    else:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def interactive(stream=None) -> bool:
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def note(message: str) -> None:
    """A dim line on stderr for progress and hints."""
    _say(message, "dim")


def notes(block: str) -> None:
    """Each line of a block of our own (the -v figures, chat's /help) a note of its own: a note
    escapes the line breaks of text from outside."""
    for line in block.splitlines():
        note(line)


def warn(message: str) -> None:
    _say(f"localinfer: warning: {message}", "yellow")


def error(message: str) -> None:
    _say(f"localinfer: error: {message}", "bold red")


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """Aligned plain-text columns on stdout: readable on a terminal, easy to cut in a pipe."""
    rows = [[clean(c) for c in row] for row in rows]     # names and values from files, servers
    widths = [max(len(c) for c in col) for col in zip(headers, *rows)]
    for row in [headers, *rows]:
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths))
        sys.stdout.write(line.rstrip() + "\n")


@contextlib.contextmanager
def progress_bar(label: str) -> Iterator[Callable[[int, int, str], None] | None]:
    """A bar on stderr updated with (done, total, item name) on a terminal; None on a pipe."""
    if not interactive():
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.markup import escape
    bar = Progress(TextColumn(escape(clean(label))), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.description}", markup=False),
                   console=stderr(), transient=True)
    with bar:
        task = bar.add_task("", total=None)

        def update(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=clean(name))
        yield update


def download_bar(total: int | None):
    """A pull's bar (fetch.DownloadBar) for commands that pull on the way, such as `run`."""
    return byte_bar("downloading", total)


@contextlib.contextmanager
def byte_bar(label: str, total: int | None) -> Iterator[Callable[[int], None] | None]:
    """A download bar on stderr (size, speed, time left) updated with bytes done, on a terminal;
    None on a pipe. It stays when done, showing the size and the speed it ran at."""
    if not interactive():
        yield None
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    class Speed(TransferSpeedColumn):
        """rich's recent speed while it runs; once done, the average over the whole pull (rich's
        last samples may be of its tail only, or too few: pip's cache answers in a blink)."""
        def render(self, task):
            if task.finished and task.elapsed:
                from rich.filesize import decimal
                from rich.text import Text
                return Text(f"{decimal(int(task.completed / task.elapsed))}/s",
                            style="progress.data.speed")
            return super().render(task)
    from rich.markup import escape
    bar = Progress(TextColumn(escape(clean(label))), BarColumn(), DownloadColumn(), Speed(),
                   TimeRemainingColumn(elapsed_when_finished=True), console=stderr())
    with bar:
        task = bar.add_task("", total=total)
        try:
            # Bytes pip has written may run past the model's size (a wheel is a zip around it).
            yield lambda done: bar.update(task, completed=min(done, total) if total else done)
        except BaseException:
            bar.update(task, visible=False)     # a failed download leaves its error line only
            raise
        if total:
            bar.update(task, completed=total)
