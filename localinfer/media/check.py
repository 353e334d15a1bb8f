"""Bytes from outside -> a checked Media value: the type from the magic bytes (never from a file
name or a declared type), then that format's header checks."""

from __future__ import annotations

from localinfer.media import audio, images
from localinfer.media.value import MAX_BYTES, Kind, Media, MediaError

_KINDS = {"png": "image", "jpeg": "image", "gif": "image", "bmp": "image",
          "wav": "audio", "mp3": "audio", "flac": "audio"}
READ = "PNG, JPEG, GIF and BMP images, WAV, MP3 and FLAC audio"
# Formats people send that llama.cpp's loaders here do not read, named in the refusal
_OTHERS = ((b"RIFF", 8, b"WEBP", "WebP"), (b"", 4, b"ftyp", "HEIF/AVIF or MP4"),
           (b"II*\x00", 0, b"", "TIFF"), (b"MM\x00*", 0, b"", "TIFF"), (b"OggS", 0, b"", "Ogg"))


def sniff(data: bytes) -> str | None:
    """The format the first bytes say, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data.startswith(b"BM") and len(data) >= 26:
        return "bmp"
    if data.startswith(b"RIFF") and data[8:12] == b"WAVE":
        return "wav"
    if data.startswith(b"fLaC"):
        return "flac"
    if data.startswith(b"ID3") or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def check(data: bytes, what: str, expect: Kind | None = None) -> Media:
    """`data` as a Media value, or a MediaError naming `what` (a file or a request field) and the
    reason. `expect`: the kind the field that carried it is for (an image_url part holds an
    image)."""
    if len(data) > MAX_BYTES:
        raise MediaError(f"{what} is {len(data):,} bytes; a medium may have at most "
                         f"{MAX_BYTES >> 20} MB")
    fmt = sniff(data)
    if fmt is None:
        raise MediaError(f"{what} is {_other(data)}; localinfer reads {READ}")
    kind = _KINDS[fmt]
    if expect is not None and kind != expect:
        raise MediaError(f"{what} holds {kind} ({fmt.upper()}) where {expect} is expected")
    if kind == "image":
        width, height = images.dimensions(fmt, data, what)
        return Media("image", fmt, data, width=width, height=height)
    return Media("audio", fmt, data, seconds=audio.seconds(fmt, data, what))


def _other(data: bytes) -> str:
    if not data:
        return "empty"
    for start, at, tag, name in _OTHERS:
        if data.startswith(start) and data[at:at + len(tag)] == tag:
            return name
    return "not an image or audio file"
