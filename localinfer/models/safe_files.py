"""Small files of our own beside the store (the chat history): read without following a link or
blocking on a pipe, and no further than a bound; written by rename, so that nothing but our own
file is ever replaced, and never a file a link at our path points to."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from localinfer.models.store import temp_path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class NotAFile(OSError):
    """Something other than a regular file is at the path: a link, a pipe, a device, a folder."""


def read_last_lines(path: Path, *, max_bytes: int) -> list[str]:
    """The lines of the text file at `path` (none when absent), from at most its last `max_bytes`:
    a line cut by that bound is left out. Undecodable bytes read as U+FFFD."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return []
    except OSError as e:
        if e.errno == errno.ELOOP:      # O_NOFOLLOW met a symlink
            raise NotAFile(f"{path} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotAFile(f"{path} is not a regular file")
        start = max(0, info.st_size - max_bytes)
        f.seek(start)
        data = f.read(max_bytes)
    lines = data.decode("utf-8", "replace").split("\n")
    if start > 0:
        lines = lines[1:]               # it began mid-line
    return lines[:-1] if lines and lines[-1] == "" else lines


def replace(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Put `data` at `path` through a temporary file renamed over it. Refused (NotAFile) unless
    `path` is a regular file of ours or absent: a link there, and the file it points to, stay."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise NotAFile(f"{path} is not a regular file")
    except FileNotFoundError:
        pass
    tmp = temp_path(path)
    tmp.unlink(missing_ok=True)         # a leftover of ours, or a link: only the name goes
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)           # replaces the name, whatever was put there meanwhile
    finally:
        tmp.unlink(missing_ok=True)
