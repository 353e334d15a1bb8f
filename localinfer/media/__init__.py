"""Images and audio from outside, checked before anything decodes them (docs/multimodal.md,
"Input checks"): the type from its magic bytes, the size and the dimensions from its header,
truncated, animated and lying files refused in one line. Nothing here decodes a pixel or a sample:
llama.cpp's multimodal library does that, on bytes that passed these checks.
"""

from localinfer.media.check import READ, check
from localinfer.media.sources import from_base64, from_data_url, is_data_url, read_path, read_stdin
from localinfer.media.value import (MARKER, MAX_BYTES, MAX_ITEMS, MAX_PIXELS, MAX_SECONDS,
                                    MAX_SIDE, Media, MediaError, count_ok)

__all__ = ["MARKER", "MAX_BYTES", "MAX_ITEMS", "MAX_PIXELS", "MAX_SECONDS", "MAX_SIDE", "READ",
           "Media", "MediaError", "check", "count_ok", "from_base64", "from_data_url",
           "is_data_url", "read_path", "read_stdin"]
