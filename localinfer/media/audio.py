"""Audio headers read before any decoder sees the file: how long the clip is (bounded: miniaudio
decodes the whole clip into floats at the model's rate, sized by what the header says), and
whether the header agrees with the file. The formats are those libmtmd's helper hands to
miniaudio: WAV, MP3 and FLAC.
"""

from __future__ import annotations

import struct

from localinfer.media.value import MAX_SECONDS, MediaError

_WAV_FORMATS = {1: "PCM", 3: "float", 6: "A-law", 7: "mu-law", 0xFFFE: "extensible"}
_RATES = (1000, 384_000)      # samples a second a real recording has
_MAX_CHANNELS = 8
_MAX_RESYNC = 4096            # junk bytes skipped between MP3 frames before giving up
# MPEG audio: bit rates in kbit/s by [version is 1][layer], and sample rates by version
_MP3_BITRATES = {
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_BITRATES[(False, 3)] = _MP3_BITRATES[(False, 2)]
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def seconds(fmt: str, data: bytes, what: str) -> float:
    """How long a WAV, MP3 or FLAC clip lasts, by its headers, refused past MAX_SECONDS."""
    length = _READERS[fmt](data, what)
    if length > MAX_SECONDS:
        raise MediaError(f"{what}: the audio lasts {length:,.0f} s; at most {MAX_SECONDS:.0f} s "
                         "are read (cut it shorter)")
    return length


def _lies(what: str, fmt: str, detail: str) -> MediaError:
    return MediaError(f"{what}: the {fmt} header does not match the file: {detail}")


def _wav(data: bytes, what: str) -> float:
    riff = struct.unpack_from("<I", data, 4)[0]
    if riff + 8 > len(data):
        raise _lies(what, "WAV", f"it says {riff + 8:,} bytes, the file has {len(data):,}")
    at, fmt = 12, None
    while at + 8 <= len(data):
        kind, size = struct.unpack_from("<4sI", data, at)
        body = at + 8
        if kind == b"fmt ":
            fmt = _wav_format(data[body:body + size], what)
        elif kind == b"data":
            if fmt is None:
                raise _lies(what, "WAV", "the samples come before their format")
            if body + size > len(data):
                raise _lies(what, "WAV", f"it says {size:,} bytes of samples, the file holds "
                                         f"{len(data) - body:,}")
            rate, align = fmt
            return size / align / rate
        at = body + size + (size & 1)       # chunks are padded to an even length
    raise _lies(what, "WAV", "no format and samples chunks")


def _wav_format(chunk: bytes, what: str) -> tuple[int, int]:
    """(sample rate, bytes a frame) of a WAV's fmt chunk, each field checked against the others."""
    if len(chunk) < 16:
        raise _lies(what, "WAV", "its format chunk is short")
    code, channels, rate, per_second, align, bits = struct.unpack_from("<HHIIHH", chunk)
    if code not in _WAV_FORMATS:
        raise MediaError(f"{what}: WAV encoding {code} is not read here; send PCM, float, "
                         "A-law or mu-law samples")
    if not 1 <= channels <= _MAX_CHANNELS or not _RATES[0] <= rate <= _RATES[1]:
        raise _lies(what, "WAV", f"{channels} channels at {rate:,} Hz")
    if bits not in (8, 16, 24, 32, 64) or align != channels * bits // 8 \
            or per_second != rate * align:
        raise _lies(what, "WAV", f"{bits} bits, {align} bytes a frame, {per_second:,} bytes a "
                                 f"second for {channels} channels at {rate:,} Hz")
    return rate, align


def _mp3(data: bytes, what: str) -> float:
    """Every frame's samples, counted frame by frame (an MP3's length is nowhere else); junk
    between frames is skipped as decoders skip it, within a bound."""
    at = _id3_end(data, what)
    total, frames, skipped = 0.0, 0, 0
    while at + 4 <= len(data):
        frame = _mp3_frame(data, at)
        if frame is None:
            skipped += 1
            if skipped > _MAX_RESYNC:
                break
            found = data.find(b"\xff", at + 1)
            if found < 0:
                break
            at = found
            continue
        size, length = frame
        at, frames, total = at + size, frames + 1, total + length
        if total > MAX_SECONDS:
            return total
    if frames == 0:
        raise MediaError(f"{what}: no MP3 frame was found in the file")
    return total


def _id3_end(data: bytes, what: str) -> int:
    """The offset past an ID3v2 tag (its size is four 7-bit bytes), or 0 when there is none."""
    if not data.startswith(b"ID3"):
        return 0
    if len(data) < 10 or any(b & 0x80 for b in data[6:10]):
        raise MediaError(f"{what}: the MP3's ID3 tag is corrupt")
    size = (data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9]
    end = 10 + size + (10 if data[5] & 0x10 else 0)        # a footer, when flagged
    if end > len(data):
        raise _lies(what, "MP3", f"its ID3 tag says {end:,} bytes, the file has {len(data):,}")
    return end


def _mp3_frame(data: bytes, at: int) -> tuple[int, float] | None:
    """(bytes, seconds) of the MPEG audio frame at `at`, or None when no valid header is there."""
    b1, b2 = data[at + 1], data[at + 2]
    if data[at] != 0xFF or b1 & 0xE0 != 0xE0:
        return None
    version, layer = (b1 >> 3) & 3, 4 - ((b1 >> 1) & 3)     # version 1 reserved; layer 4: none
    bit_index, rate_index, padding = b2 >> 4, (b2 >> 2) & 3, (b2 >> 1) & 1
    if version == 1 or layer == 4 or bit_index in (0, 15) or rate_index == 3:
        return None
    mpeg1 = version == 3
    bitrate = _MP3_BITRATES[(mpeg1, layer)][bit_index] * 1000
    rate = _MP3_RATES[version][rate_index]
    if layer == 1:
        return (12 * bitrate // rate + padding) * 4, 384 / rate
    samples = 1152 if layer == 2 or mpeg1 else 576
    return samples // 8 * bitrate // rate + padding, samples / rate


def _flac(data: bytes, what: str) -> float:
    """The length STREAMINFO declares (what the decoder allocates for), its blocks inside the
    file and audio frames after them."""
    at, length = 4, None
    while True:
        if at + 4 > len(data):
            raise MediaError(f"{what}: the FLAC file is truncated")
        header, size = data[at], int.from_bytes(data[at + 1:at + 4], "big")
        if at + 4 + size > len(data):
            raise MediaError(f"{what}: the FLAC file is truncated")
        if header & 0x7F == 0 and size >= 18:            # STREAMINFO
            info = int.from_bytes(data[at + 14:at + 22], "big")
            rate, channels = info >> 44, ((info >> 41) & 7) + 1
            samples = info & ((1 << 36) - 1)
            if not _RATES[0] <= rate <= _RATES[1] or channels > _MAX_CHANNELS or samples == 0:
                raise _lies(what, "FLAC", f"{samples:,} samples at {rate:,} Hz")
            length = samples / rate
        at += 4 + size
        if header & 0x80:                                # the last metadata block
            break
    if length is None:
        raise _lies(what, "FLAC", "no STREAMINFO block")
    if data[at:at + 2] not in (b"\xff\xf8", b"\xff\xf9"):
        raise MediaError(f"{what}: the FLAC file has no audio frames")
    return length


_READERS = {"wav": _wav, "mp3": _mp3, "flac": _flac}
