"""Where media come from: a file or stdin (run --image), base64 text and data: URLs (the APIs).
Each reads at most MAX_BYTES (+1, to tell a larger input apart) and hands the bytes to check()."""

from __future__ import annotations

import base64
import binascii
import os
import re
import sys
from pathlib import Path

from localinfer.media.check import check
from localinfer.media.value import MAX_BYTES, Kind, Media, MediaError

# base64 text of MAX_BYTES bytes, with room for line breaks
_MAX_TEXT = (MAX_BYTES + 2) // 3 * 4 + (MAX_BYTES >> 6) + 64
_SPACE = re.compile(rb"[ \t\r\n]+")
_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[\w.+-]+)*)(;base64)?,",
                       re.ASCII)


def read_path(path: str | Path, expect: Kind | None = None) -> Media:
    """A file's medium (`-`: stdin), its size checked before a byte is read."""
    if str(path) == "-":
        return read_stdin(expect)
    what = str(path)
    try:
        size = os.stat(path).st_size
        if size > MAX_BYTES:
            raise MediaError(f"{what} is {size:,} bytes; a medium may have at most "
                             f"{MAX_BYTES >> 20} MB")
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)    # a device or a growing file says nothing by stat
    except IsADirectoryError:
        raise MediaError(f"{what} is a directory, not an image or audio file") from None
    except OSError as e:
        raise MediaError(f"cannot read {what}: {e.strerror or e}") from None
    return check(data, what, expect)


def read_stdin(expect: Kind | None = None) -> Media:
    return check(sys.stdin.buffer.read(MAX_BYTES + 1), "stdin", expect)


def from_base64(text, what: str, expect: Kind | None = None) -> Media:
    """Base64 text (line breaks allowed) as a medium; anything else in it is a refusal."""
    if not isinstance(text, str):
        raise MediaError(f"{what} must be a base64 string")
    if len(text) > _MAX_TEXT:
        raise MediaError(f"{what} is {len(text):,} characters of base64; a medium may have at "
                         f"most {MAX_BYTES >> 20} MB")
    try:
        data = base64.b64decode(_SPACE.sub(b"", text.encode("ascii")), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        raise MediaError(f"{what} is not base64") from None
    return check(data, what, expect)


def from_data_url(url, what: str, expect: Kind | None = None) -> Media:
    """A `data:TYPE;base64,...` URL whose TYPE is an image or audio type."""
    match = _DATA_URL.match(url) if isinstance(url, str) else None
    if match is None:
        raise MediaError(f"{what} is not a data: URL")
    declared, encoded = (match.group(1) or "").lower(), match.group(3)
    if declared.split("/")[0] not in ("image", "audio"):
        raise MediaError(f"{what} is a data: URL of {declared or 'text'}, not of an image or "
                         "audio clip")
    if not encoded:
        raise MediaError(f"{what} is a data: URL without ;base64: send the bytes base64-encoded")
    return from_base64(url[match.end():], what, expect)


def is_data_url(url) -> bool:
    return isinstance(url, str) and url[:5].lower() == "data:"
