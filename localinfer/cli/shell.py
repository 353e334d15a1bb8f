"""How localinfer talks to the shell: piped stdin combined with the prompt, the answer streamed to
stdout (or one JSON object), the figures on stderr, and the standard streams a shell may have
closed or filled with something other than text."""

from __future__ import annotations

import codecs
import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from localinfer.cli import console
from localinfer.errors import LocalinferError, UsageError
from localinfer.units import counted, human_size

if TYPE_CHECKING:
    from localinfer.engine.decode import Generation
    from localinfer.engine.load import LoadedModel
    from localinfer.engine.prompt import PromptText


def read_stdin(limit: int | None = None) -> str | None:
    """Piped input as text, or None when stdin is a terminal or absent.

    At most `limit` bytes are read (settings' stdin_bytes by default), so `yes | localinfer run ...`
    ends at once; input that is not UTF-8 text is refused at its first bad byte rather than guessed
    at, so `localinfer run ... < /dev/urandom` ends at once too.
    """
    stream = sys.stdin
    if stream is None or console.interactive(stream):
        return None
    limit = _stdin_limit(limit)
    try:
        return _read_text(getattr(stream, "buffer", None) or _Encoded(stream), limit)
    except ValueError:          # closed by whoever started us
        return None
    except OSError as e:        # e.g. a directory given as stdin
        raise UsageError(f"cannot read stdin: {e.strerror or e}") from e


_CHUNK = 1 << 16


def _read_text(stream, limit: int) -> str:
    """UTF-8 text of at most `limit` bytes, newlines as text-mode stdin gives them."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts: list[str] = []
    size = 0
    while True:
        chunk = stream.read1(_CHUNK)
        final = not chunk
        start = size - len(decoder.getstate()[0])   # where the bytes decoded next begin
        try:
            parts.append(decoder.decode(chunk, final=final))
        except UnicodeDecodeError as e:
            raise _not_utf8(f"invalid byte at offset {start + e.start}") from e
        if "\0" in parts[-1]:
            raise _nul_in_stdin()
        size += len(chunk)
        if size > limit:
            raise UsageError(f"stdin holds more than {human_size(limit)}; pipe less "
                             "(e.g. `head -c 1M FILE |`) or raise LOCALINFER_STDIN_BYTES (e.g. 64M)")
        if final:
            return "".join(parts).replace("\r\n", "\n").replace("\r", "\n")


def stdin_lines(limit: int | None = None) -> Iterator[list[str]] | None:
    """Piped input line by line as it comes (`map`): the lines each read of stdin completes, or
    None when stdin is a terminal or absent.

    Lines end at `\\n` alone, as `wc -l` and `while read` count them: a `\\r` before it goes
    with it, and `\\r`, form feeds or U+2028 inside a line stay in it; a last line without a
    newline is a line. Each line holds at most `limit` bytes (settings' stdin_bytes by default)
    and must be UTF-8 text without NUL; the whole input is unbounded, since it is never held.
    A bad line is raised where it comes, after the lines before it are given.
    """
    stream = sys.stdin
    if stream is None or console.interactive(stream):
        return None
    limit = _stdin_limit(limit)
    try:
        reader = _Descriptor(stream.fileno())
    except (AttributeError, OSError, ValueError):   # no descriptor: a stream a test substitutes
        reader = getattr(stream, "buffer", None) or _Encoded(stream)
    return _lines(reader, limit)


class _Descriptor:
    """Reads of a file descriptor, no Python buffer between: `map` reads stdin in a thread of its
    own, and one blocked inside a buffered reader holds its lock, which Python's exit then waits
    for and aborts on (exit 134 at Ctrl-C)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def read1(self, n: int) -> bytes:
        return os.read(self._fd, n)


def _lines(stream, limit: int) -> Iterator[list[str]]:
    pending = bytearray()
    start = number = 0                  # where `pending` begins in the input; lines given
    while True:
        try:
            chunk = stream.read1(_CHUNK)
        except ValueError:              # closed by whoever started us
            chunk = b""
        except OSError as e:            # e.g. a directory given as stdin
            raise UsageError(f"cannot read stdin: {e.strerror or e}") from e
        seen = len(pending)
        pending += chunk
        lines: list[str] = []
        try:
            end = pending.find(b"\n", seen)
            while end >= 0 or (not chunk and pending):
                cut = end if end >= 0 else len(pending)
                lines.append(_line_text(bytes(pending[:cut]), start, len(lines) + number + 1,
                                        limit))
                del pending[:cut + 1]
                start += cut + 1
                end = pending.find(b"\n")
            if len(pending) > limit + 1:        # + 1: a \r that may go with its newline
                raise _line_too_long(number + len(lines) + 1, limit)
        except UsageError:
            if lines:
                yield lines
            raise
        number += len(lines)
        if lines:
            yield lines
        if not chunk:
            return


def _line_text(data: bytes, start: int, number: int, limit: int) -> str:
    if data.endswith(b"\r"):
        data = data[:-1]
    if len(data) > limit:
        raise _line_too_long(number, limit)
    if b"\0" in data:
        raise _nul_in_stdin()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(f"invalid byte at offset {start + e.start}, line {number}") from e


def _line_too_long(number: int, limit: int) -> UsageError:
    return UsageError(f"stdin line {number} holds more than {human_size(limit)}; split it, or "
                      "raise LOCALINFER_STDIN_BYTES (e.g. 64M), the most one line may hold")


def chat_line(read: Callable[[], str]) -> str:
    """One line of chat input from `read` (input()), refused like piped text when it is not text:
    Python hands undecodable bytes on as lone surrogates, or fails on them, by locale."""
    try:
        line = read()
    except UnicodeDecodeError as e:
        raise _not_utf8(f"invalid byte 0x{e.object[e.start]:02x}") from e
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        raise _not_utf8() from None
    if "\0" in line:
        raise _nul_in_stdin()
    return line


def _not_utf8(detail: str = "") -> UsageError:
    where = f" ({detail})" if detail else ""
    return UsageError(f"stdin is not UTF-8 text{where}; pipe text, or convert it first, "
                      "e.g. with `iconv -f latin1 -t utf-8`")


def _nul_in_stdin() -> UsageError:
    # Binary data, or UTF-16 text: ASCII in UTF-16 is valid UTF-8 with a NUL after every letter.
    return UsageError("stdin holds a NUL character: binary data, not text; convert UTF-16 text "
                      "with `iconv -f utf-16 -t utf-8`")


class _Encoded:
    """A text stream (as tests substitute for stdin) read as UTF-8 bytes."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def read1(self, n: int) -> bytes:
        return self._stream.read(n).encode("utf-8", "surrogateescape")


def check_arguments(args: list[str]) -> None:
    """Refuse an argument whose bytes are not UTF-8: Python carries them as lone surrogates that
    fail far away (in the tokenizer, on output), not here where the cause is plain."""
    for arg in args:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(arg).decode("utf-8", "backslashreplace")
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise UsageError(f"the argument '{shown}' is not UTF-8 text; pass it in UTF-8 "
                             "(e.g. convert it with iconv)") from None


class ClosedStdout(io.TextIOBase):
    """Stands in for a stdout the shell closed (`>&-`): a command that prints nothing still
    succeeds, one that has an answer to print ends with one clear line."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text:
            raise LocalinferError("stdout is closed, so the answer has nowhere to go; "
                                  "redirect it to a file or to /dev/null instead")
        return 0


def guard_standard_streams() -> None:
    """Keep file descriptors 0-2 taken and sys.stdout/sys.stderr usable when the shell closed them.

    A closed descriptor is handed to the next file opened (a model, a cache entry), and whatever
    then writes to "stdout" or "stderr" would write into that file; /dev/null holds the place.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)   # the lowest free number: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdout is None:
        sys.stdout = ClosedStdout()
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")


def redeliver_lost_interrupts() -> None:
    """Python raises KeyboardInterrupt wherever the main thread is when Ctrl-C comes. In a
    garbage-collector callback or a __del__ (gen-0 collections run hundreds of times a second
    while a reply streams) it is printed as "Exception ignored" and dropped, and the reply goes
    on as if no key had been pressed. Such a Ctrl-C is delivered again, from another thread a
    moment later, when the callback is over."""
    previous = sys.unraisablehook
    if getattr(previous, "redelivers", False):
        return

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            import _thread
            import threading
            again = threading.Timer(0.01, _thread.interrupt_main)
            again.daemon = True     # at exit it is not waited for (nor raised into the wait)
            again.start()
            return
        previous(unraisable)
    hook.redelivers = True
    sys.unraisablehook = hook


def quiet_broken_pipe() -> None:
    """The reader of stdout (e.g. `head`) went away: a normal end in a pipeline. What is still
    buffered goes to /dev/null, so Python's flush at exit neither fails nor prints."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def prompt_text(stdin_text: str | None, prompt: str | None, *, system: str | None,
                raw: bool) -> PromptText:
    """The prompt as `run` sends it: combined as combine_input does, the piped part marked as
    the part --truncate may shorten."""
    from localinfer.engine.prompt import PromptText
    piped = (stdin_text or "").rstrip("\n")
    return PromptText(combine_input(stdin_text, prompt), len(piped) if piped.strip() else 0,
                      system, raw)


def combine_input(stdin_text: str | None, prompt: str | None) -> str:
    """`{stdin}\\n\\n{prompt}`, either part optional; prompt '-' means stdin alone."""
    if prompt == "-":
        prompt = None
    parts = [p for p in ((stdin_text or "").rstrip("\n"), prompt or "") if p.strip()]
    if not parts:
        raise UsageError("the prompt is empty; pass PROMPT or pipe text on stdin")
    return "\n\n".join(parts)


def emit(generation: Generation, loaded: LoadedModel, *, as_json: bool, verbose: bool,
         show_trace: bool = False):
    """Stream the answer to stdout (or print it in one JSON object); a thinking model's trace goes
    to stderr when `show_trace`, else nowhere. Returns the cli.thinking.Output with both texts."""
    from localinfer.cli.thinking import Output
    out = Output(generation.style, show_trace=show_trace and not as_json, stream=not as_json)
    try:
        for piece in generation:
            out.feed(piece)
    except KeyboardInterrupt:
        generation.stats.finish_reason = "interrupted"
        out.flush()
        _finish(generation, loaded, out, as_json=as_json, verbose=verbose)
        raise
    out.flush()
    _finish(generation, loaded, out, as_json=as_json, verbose=verbose)
    return out


def _finish(generation: Generation, loaded: LoadedModel, out, *,
            as_json: bool, verbose: bool) -> None:
    from localinfer.cli import gpu
    stats = generation.stats
    if as_json:
        trace = {"reasoning": out.reasoning} if out.thinking else {}
        record = {"model": loaded.ref.display, "backend": loaded.backend, "text": out.answer,
                  **trace, **stats.as_dict(), **gpu.offload_facts(loaded)}
        if generation.limits.logprobs is not None:     # every token's, a trace's too
            from localinfer.engine.logprobs import records
            record["logprobs"] = records(generation.logprobs, loaded.session.piece)
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    elif not out.answer.endswith("\n") and (out.answer or not out.thinking):
        sys.stdout.write("\n")   # end the answer's line, as shell tools do; $(...) drops it
    sys.stdout.flush()
    if verbose:
        from localinfer.cache import prompt_cache
        console.notes(format_stats(stats, loaded))
        from localinfer.pipeline.reuse import describe
        if (reused := describe(generation)) is not None:
            console.note(reused)
        gpu.say_offload(loaded)
        if generation.cache.store is not None:
            console.note(prompt_cache.describe(generation.cache.last_event))
        if hasattr(stats, "drafted"):
            from localinfer.speculate.choose import describe
            console.note(describe(stats))


def format_stats(stats, loaded: LoadedModel) -> str:
    """The -v block, one figure a line as Ollama's --verbose prints them: what a user feels first
    (time to first token) apart from the rates (prefill, decode)."""
    cached = f" ({stats.cached_tokens} cached)" if stats.cached_tokens else ""
    return (f"model: {loaded.ref.display} on {loaded.backend}\n"
            f"load: {stats.load_s:.2f} s\n"
            f"prompt: {counted(stats.prompt_tokens, 'token')}{cached} · ttft {stats.ttft_s * 1000:.0f} ms · "
            f"prefill {stats.prefill_tps:.1f} t/s\n"
            f"reply: {counted(stats.generated_tokens, 'token')} · decode {stats.decode_tps:.1f} t/s "
            f"({stats.finish_reason})"
            + (f"\nschema: closed early to fit the limit (its last "
               f"{counted(stats.closed_tokens, 'token')})" if stats.closed_at >= 0 else ""))


def closed_early(stats, max_tokens: int, n_ctx: int, *, unasked: bool = False) -> str:
    """The note for an answer the budget narrowed to close its document in time; `unasked`:
    max_tokens is the bound an answer with no -n gets (structured.answer_limit)."""
    by_n = 0 < max_tokens <= n_ctx - stats.prompt_tokens + 1
    limit = f"-n {max_tokens}" if by_n else f"the context ({n_ctx:,} tokens)"
    if by_n and unasked:
        limit = f"{max_tokens:,} tokens (the bound of a constrained answer without -n)"
    more = "a larger -n" if by_n else "-n N or --ctx N"
    return (f"the answer was cut to fit {limit}: its last {counted(stats.closed_tokens, 'token')} "
            f"closed the document early; {more} gives the model room to finish it")


def _stdin_limit(limit: int | None) -> int:
    """The bound asked for, else settings' stdin_bytes."""
    if limit is not None:
        return limit
    from localinfer import settings
    return settings.load().stdin_bytes
