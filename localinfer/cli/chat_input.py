"""What `chat` reads from its user, and how it keeps the terminal out of the answer.

A message is one line, or several: a line ending in `\\` goes on to the next, and a line that
starts with `\"\"\"` opens a block that ends at a line ending in `\"\"\"` (as `ollama run`
reads them).
Piped input follows the same syntax, without prompts.

While a reply streams, the terminal neither echoes keys nor gathers them into lines, so what the
user types meanwhile stays out of the answer; the keys stay queued and the next prompt's line
editor reads them as if typed there (as `ollama run` hands keys typed during a reply to its next
prompt, and a shell treats type-ahead).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from localinfer.cli import console, shell

PROMPT, MORE = ">>> ", "... "
QUOTES = '"""'
HELP = "\n".join((
    "  /help, /?             this list",
    "  /clear                forget the conversation",
    "  /system TEXT          set the system message (the conversation restarts)",
    "  /image PATH, /audio PATH  send a picture or a clip with your next message",
    "  /exit, /bye, /quit    leave (Ctrl-D too)",
    "  a line ending in \\    the message continues on the next line",
    f"  {QUOTES} ... {QUOTES}           several lines, up to a line that ends in {QUOTES}",
    "  Ctrl-C                stop the answer, or drop the message being typed",
))


@dataclass(frozen=True)
class Message:
    text: str
    block: bool = False       # a """ block: text as typed, never a command


class Unfinished(EOFError):
    """The input ended inside a message of several lines."""


def read_message(read: Callable[[str], str], *, prompts: bool) -> Message:
    """One message from `read(prompt)` (one line per call; EOFError at the end of input); no
    prompts shown when `prompts` is false (piped input)."""
    first = read(PROMPT if prompts else "")

    def more() -> str:
        try:
            return read(MORE if prompts else "")
        except EOFError:
            raise Unfinished from None
    if first.lstrip().startswith(QUOTES):
        return Message(_block(first.lstrip()[len(QUOTES):], more), block=True)
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]      # the backslash goes; the line break stays
        lines.append(more())
    return Message("\n".join(lines))


def _block(rest: str, more: Callable[[], str]) -> str:
    """The text of a block whose first line, after its opening quotes, is `rest`. Empty first and
    last lines (the quotes alone on a line) are not part of the message."""
    lines = []
    line = rest
    while not line.rstrip().endswith(QUOTES):
        lines.append(line)
        line = more()
    lines.append(line.rstrip()[:-len(QUOTES)])
    if lines and not lines[0].strip():
        lines.pop(0)
    if lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines)


@contextlib.contextmanager
def keys_held(stdin) -> Iterator[None]:
    """Echo and line gathering off on the terminal `stdin` while the block runs, restored after
    (on Ctrl-C and errors too); nothing changes when stdin is not a terminal."""
    saved = _attributes(stdin)
    if saved is None:
        yield
        return
    import termios
    fd = stdin.fileno()
    held = list(saved)
    held[3] = saved[3] & ~(termios.ECHO | termios.ICANON)   # lflags; ISIG stays: Ctrl-C works
    # TCSANOW, never TCSAFLUSH: a flush would throw away what was typed ahead.
    termios.tcsetattr(fd, termios.TCSANOW, held)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _attributes(stdin) -> list | None:
    """The terminal settings of `stdin`, or None when it is not a terminal we can set."""
    try:
        import termios
    except ImportError:         # Windows: its console does not echo into the output this way
        return None
    try:
        fd = stdin.fileno()
        return termios.tcgetattr(fd) if os.isatty(fd) else None
    except (AttributeError, OSError, ValueError, termios.error):
        return None


def converse(prompts: bool, command: Callable[[str], bool], take: Callable[[str], None],
             chat) -> None:
    """Read messages (with prompts when `prompts`) and obey or answer each, until the input ends
    or a command ends the chat. A Ctrl-C after a message is read and before its reply begins
    (a module still loading, the prompt being rendered) drops that message, as if never asked:
    the reply itself keeps what came, and the chat goes on."""
    while (message := _next_message(prompts)) is not None:
        try:
            text = message.text
            if not message.block and text.strip().startswith("/"):
                if not command(text.strip()):
                    return
            elif text.strip():
                take(text)
        except KeyboardInterrupt:
            sys.stderr.write("\n")
            if chat.messages and chat.messages[-1]["role"] == "user":   # never answered
                chat.messages.pop()


def _next_message(prompts: bool) -> Message | None:
    """The user's next message; an empty one after Ctrl-C (which drops what was being typed);
    None at the end of input."""
    try:
        return read_message(lambda prompt: shell.chat_line(lambda: input(prompt)),
                            prompts=prompts)
    except Unfinished:
        sys.stderr.write("\n")
        console.note("the input ended inside a message of several lines; it was not sent")
        return None
    except EOFError:
        sys.stderr.write("\n")
        return None
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return Message("")
