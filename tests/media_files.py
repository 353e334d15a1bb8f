"""Tiny media files built in memory for the media tests: valid ones (a real PNG llama.cpp's
loader decodes) and hostile ones (bombs, truncations, lying headers), nothing large on disk."""

from __future__ import annotations

import base64
import struct
import zlib


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + \
        struct.pack(">I", zlib.crc32(kind + payload))


def png(width: int = 8, height: int = 8, *, stream: bytes | None = None, frames: int = 0,
        seed: int = 0) -> bytes:
    """An RGB PNG (a gradient, so two seeds differ); `stream`: the IDAT data as given (a bomb);
    `frames`: an acTL chunk saying that many frames (APNG)."""
    if stream is None:
        rows = b"".join(b"\x00" + bytes((x * 7 + y * 13 + seed) & 255 for x in range(width * 3))
                        for y in range(height))
        stream = zlib.compress(rows)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    animation = _chunk(b"acTL", struct.pack(">II", frames, 0)) if frames else b""
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + animation + \
        _chunk(b"IDAT", stream) + _chunk(b"IEND", b"")


def inflating(size: int) -> bytes:
    """A zlib stream of `size` zero bytes (it compresses about a thousandfold)."""
    packer = zlib.compressobj(9)
    block = bytes(1 << 20)
    out = [packer.compress(block) for _ in range(size >> 20)]
    return b"".join(out) + packer.compress(bytes(size & ((1 << 20) - 1))) + packer.flush()


def jpeg(width: int = 8, height: int = 8, *, end: bool = True) -> bytes:
    """The markers of a baseline JPEG (its scan data is filler: enough for the header checks)."""
    sof = struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00"
    sos = struct.pack(">B", 3) + b"\x01\x00\x02\x11\x03\x11" + b"\x00\x3f\x00"
    return b"\xff\xd8" + b"\xff\xc0" + struct.pack(">H", len(sof) + 2) + sof + \
        b"\xff\xda" + struct.pack(">H", len(sos) + 2) + sos + b"\x12\x34" * 8 + \
        (b"\xff\xd9" if end else b"")


def gif(width: int = 4, height: int = 4, frames: int = 1) -> bytes:
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x4c\x01\x00"
    return b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + bytes(6) + \
        frame * frames + b"\x3b"


def bmp(width: int = 4, height: int = 4) -> bytes:
    row = (width * 24 + 31) // 32 * 4
    pixels = bytes(row * height)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(pixels), 0, 0, 0, 0)
    return b"BM" + struct.pack("<IHHI", 54 + len(pixels), 0, 0, 54) + info + pixels


def wav(seconds: float = 0.25, rate: int = 16000, *, riff: int | None = None,
        data_size: int | None = None, channels: int = 1) -> bytes:
    """16-bit PCM (a quiet tone); riff/data_size: what the header claims, when it lies."""
    frames = int(seconds * rate)
    samples = b"".join(struct.pack("<h", (i * 37 % 200) - 100) * channels for i in range(frames))
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + \
        struct.pack("<I", len(samples) if data_size is None else data_size) + samples
    return b"RIFF" + struct.pack("<I", len(body) if riff is None else riff) + body


def mp3(frames: int = 4) -> bytes:
    """MPEG-1 layer III frames at 128 kbit/s, 44.1 kHz (417 bytes each, silent payload)."""
    return (b"\xff\xfb\x90\x00" + bytes(413)) * frames


def flac(samples: int = 4000, rate: int = 16000) -> bytes:
    info = struct.pack(">HH", 4096, 4096) + bytes(6) + \
        ((rate << 44) | (0 << 41) | (15 << 36) | samples).to_bytes(8, "big") + bytes(16)
    return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info + b"\xff\xf8" + bytes(16)


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"
