"""The Media value and the bounds every medium is held to."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

from localinfer.errors import UsageError

# Bounds, chosen so that no request can make the decoders allocate more than a few hundred MB:
# stb_image decodes to 3 bytes a pixel, miniaudio to one float a sample at the model's rate.
MAX_BYTES = 20 << 20          # one encoded medium (OpenAI's own limit for an image)
MAX_SIDE = 16384              # pixels on either side (stb_image's own cap is 2**24)
MAX_PIXELS = 40_000_000       # width x height: a bomb's header says 2.5e9, and is refused here
MAX_SECONDS = 600.0           # of audio; encoders read 30 s windows, this is 20 of them
MAX_ITEMS = 32                # media in one request or one prompt
# libmtmd's default marker: where a medium goes in a prompt's text (mtmd_default_marker)
MARKER = "<__media__>"

Kind = Literal["image", "audio"]


class MediaError(UsageError):
    """A medium refused before decoding: one line, exit 2 (a 400 on the APIs)."""


@dataclass(frozen=True)
class Media:
    """One checked image or audio clip. `data` is the file's bytes as sent, for libmtmd's loader;
    `digest` the SHA-256 of those bytes (what libmtmd's helper uses as the medium's id)."""

    kind: Kind
    format: str                   # png, jpeg, gif, bmp; wav, mp3, flac
    data: bytes = field(repr=False)
    width: int = 0                # images
    height: int = 0
    seconds: float = 0.0          # audio
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.digest:
            object.__setattr__(self, "digest", hashlib.sha256(self.data).hexdigest())

    def describe(self) -> str:
        size = f"{self.width}x{self.height}" if self.kind == "image" else f"{self.seconds:.1f} s"
        return f"{self.format.upper()} {self.kind}, {size}"


def count_ok(n: int, where: str) -> None:
    """Refuse more than MAX_ITEMS media in one request or prompt."""
    if n > MAX_ITEMS:
        raise MediaError(f"{where} holds {n:,} images or audio clips; at most {MAX_ITEMS} may "
                         "go in one request")
