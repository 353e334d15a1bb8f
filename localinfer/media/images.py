"""Image headers read before any decoder sees the file: the dimensions (bounded, so a few-KB
file cannot ask for gigabytes of pixels), whether the file is whole, and whether it is one frame.

The formats are those llama.cpp's image loader (stb_image, through libmtmd's helper) reads and
people send: PNG, JPEG, GIF, BMP. A PNG's compressed data is inflated here once, in bounded steps
and thrown away, because stb_image grows its inflate buffer to whatever the stream holds (up to
4 GB) whatever the header says.
"""

from __future__ import annotations

import struct
import zlib

from localinfer.media.value import MAX_PIXELS, MAX_SIDE, MediaError

_STEP = 1 << 20               # bytes inflated at a time while a PNG's data is measured
# PNG colour type -> channels, and the bit depths each allows
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
# JPEG start-of-frame markers (C4 DHT, C8 JPG and CC DAC share the range and are not frames)
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_BMP_COMPRESSION = (0, 3)     # BI_RGB, BI_BITFIELDS: what stb_image reads (no RLE)


def dimensions(fmt: str, data: bytes, what: str) -> tuple[int, int]:
    """(width, height) of a PNG, JPEG, GIF or BMP whose whole file passed the checks."""
    width, height = _READERS[fmt](data, what)
    bounded(width, height, what)
    return width, height


def bounded(width: int, height: int, what: str) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(f"{what}: the image header says {width}x{height} pixels")
    if width > MAX_SIDE or height > MAX_SIDE or width * height > MAX_PIXELS:
        raise MediaError(f"{what}: the image is {width:,}x{height:,} pixels; at most "
                         f"{MAX_SIDE:,} a side and {MAX_PIXELS // 1_000_000} megapixels are "
                         "read (scale it down)")


def _truncated(what: str, fmt: str) -> MediaError:
    return MediaError(f"{what}: the {fmt} file is truncated or corrupt")


def _png_chunks(data: bytes, what: str):
    """(type, payload) of each chunk up to IEND, each one inside the file with its CRC right."""
    at = 8
    while True:
        if at + 12 > len(data):
            raise _truncated(what, "PNG")
        size, kind = struct.unpack_from(">I4s", data, at)
        end = at + 12 + size
        if end > len(data):
            raise _truncated(what, "PNG")
        payload = data[at + 8:end - 4]
        if zlib.crc32(kind + payload) != struct.unpack_from(">I", data, end - 4)[0]:
            raise _truncated(what, "PNG")
        yield kind, payload
        if kind == b"IEND":
            return
        at = end


def _png(data: bytes, what: str) -> tuple[int, int]:
    chunks = _png_chunks(data, what)
    kind, header = next(chunks)
    if kind != b"IHDR" or len(header) != 13:
        raise _truncated(what, "PNG")
    width, height, depth, colour = struct.unpack_from(">IIBB", header)
    if depth not in _PNG_DEPTHS.get(colour, ()):
        raise MediaError(f"{what}: the PNG header has colour type {colour} at {depth} bits, "
                         "which no PNG has")
    stream = []
    for kind, payload in chunks:
        if kind == b"acTL" and len(payload) >= 4 and struct.unpack_from(">I", payload)[0] > 1:
            raise _animated(what, "PNG")
        if kind == b"IDAT":
            stream.append(payload)
    if not stream:
        raise _truncated(what, "PNG")
    bounded(width, height, what)
    row = (width * _PNG_CHANNELS[colour] * depth + 7) // 8 + 1
    _inflates_within(b"".join(stream), height * row + 4 * height + 64, what)
    return width, height


def _inflates_within(stream: bytes, most: int, what: str) -> None:
    """A PNG's IDAT stream inflates, whole, to at most `most` bytes (the rows its header declares,
    with room for Adam7's extra filter bytes), measured _STEP bytes at a time and discarded."""
    inflater = zlib.decompressobj()
    out = 0
    try:
        while True:
            pending = inflater.decompress(stream, _STEP)
            out += len(pending)
            if out > most:
                raise MediaError(f"{what}: the PNG's data inflates past the pixels its header "
                                 "declares (a decompression bomb)")
            stream = inflater.unconsumed_tail
            if inflater.eof or (not stream and len(pending) < _STEP):
                break
    except zlib.error:
        raise _truncated(what, "PNG") from None
    if not inflater.eof:
        raise _truncated(what, "PNG")


def _jpeg(data: bytes, what: str) -> tuple[int, int]:
    at, size = 2, None
    while True:
        if at + 4 > len(data) or data[at] != 0xFF:
            raise _truncated(what, "JPEG")
        marker = data[at + 1]
        if marker == 0xFF:                  # fill bytes before a marker
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:   # markers without a length
            at += 2
            continue
        length = struct.unpack_from(">H", data, at + 2)[0]
        if length < 2 or at + 2 + length > len(data):
            raise _truncated(what, "JPEG")
        if marker in _SOF and size is None:
            if length < 8:
                raise _truncated(what, "JPEG")
            height, width = struct.unpack_from(">HH", data, at + 5)
            size = (width, height)
        if marker == 0xDA:                  # start of scan: entropy-coded data follows
            break
        at += 2 + length
    if size is None:
        raise _truncated(what, "JPEG")
    if data.rfind(b"\xff\xd9") < at:        # no end-of-image marker after the scan
        raise _truncated(what, "JPEG")
    return size


def _gif(data: bytes, what: str) -> tuple[int, int]:
    if len(data) < 13:
        raise _truncated(what, "GIF")
    width, height, packed = struct.unpack_from("<HHB", data, 6)
    at = 13 + (3 << ((packed & 7) + 1) if packed & 0x80 else 0)
    frames = 0
    while True:
        if at >= len(data) and frames:      # a whole frame, and no trailer: read as decoders do
            break
        if at >= len(data):
            raise _truncated(what, "GIF")
        block = data[at]
        if block == 0x3B:                   # trailer
            break
        if block == 0x21:                   # extension: label, then sub-blocks
            at = _gif_sub_blocks(data, at + 2, what)
        elif block == 0x2C:                 # image descriptor
            frames += 1
            if frames > 1:
                raise _animated(what, "GIF")
            if at + 10 > len(data):
                raise _truncated(what, "GIF")
            local = data[at + 9]
            at += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0) + 1  # + LZW code size
            at = _gif_sub_blocks(data, at, what)
        else:
            raise _truncated(what, "GIF")
    if frames == 0:
        raise _truncated(what, "GIF")
    return width, height


def _gif_sub_blocks(data: bytes, at: int, what: str) -> int:
    """The offset past a chain of sub-blocks (each a length byte, 0 ends the chain)."""
    while True:
        if at >= len(data):
            raise _truncated(what, "GIF")
        size = data[at]
        at += 1 + size
        if size == 0:
            return at


def _bmp(data: bytes, what: str) -> tuple[int, int]:
    if len(data) < 26:
        raise _truncated(what, "BMP")
    offset, header = struct.unpack_from("<II", data, 10)
    if header == 12:                        # OS/2's core header: 16-bit sides
        width, height, _, bits = struct.unpack_from("<HHHH", data, 18)
        compression = 0
    elif header in (40, 52, 56, 108, 124) and len(data) >= 14 + header:
        width, height, _, bits, compression = struct.unpack_from("<iiHHI", data, 18)
    else:
        raise _truncated(what, "BMP")
    height = abs(height)                    # negative: rows stored top-down
    if bits not in (1, 4, 8, 16, 24, 32) or compression not in _BMP_COMPRESSION:
        raise MediaError(f"{what}: a BMP of {bits} bits a pixel with compression {compression} "
                         "is not read here; send PNG or JPEG")
    bounded(width, height, what)
    row = (width * bits + 31) // 32 * 4
    if offset < 14 + header or offset + row * height > len(data):
        raise _truncated(what, "BMP")
    return width, height


def _animated(what: str, fmt: str) -> MediaError:
    return MediaError(f"{what}: an animated {fmt} is not read here (the model would see one "
                      "frame); send the frame you mean as a PNG or JPEG")


_READERS = {"png": _png, "jpeg": _jpeg, "gif": _gif, "bmp": _bmp}
