"""What a multimodal projector (mmproj) adds to a model's memory: its weights, which libmtmd
reads into memory whole, and its encoder's compute buffer for one image or one 30 s audio window,
estimated from the projector's header (never measured on a real model here: docs/multimodal.md).

The encoder attends over every patch (or audio frame) at once: one layer's attention scores,
n^2 x heads in f32, dominate its activations; a few rows of width max(embedding, feed-forward)
come beside them. Header values are bounded first: a hostile header cannot make the arithmetic
explode, only the estimate (and so the fit's refusal) large.
"""

from __future__ import annotations

from pathlib import Path

from localinfer.errors import UsageError

_MAX_POSITIONS = 1 << 16      # patches or frames one encoder pass attends over
_AUDIO_POSITIONS = 1500       # a Whisper-style encoder's frames for its 30 s window
_ROWS = 8                     # activation rows of width max(embedding, feed-forward) beside them


def projector_bytes(path: str | Path | None) -> int:
    """Bytes the projector `path` adds (0 without one, or while it is still to be found beside
    a model not yet pulled: engine/media.py's AUTO and MAYBE)."""
    if not path or str(path) in ("auto", "maybe"):
        return 0
    from localinfer.gguf.header import read_header
    path = Path(path)
    try:
        meta = read_header(path).metadata
        size = path.stat().st_size
    except OSError as e:
        raise UsageError(f"cannot read the projector {path}: {e.strerror or e}") from None
    return size + encoder_compute(meta)


def planned_bytes(variant, *, remote: bool) -> int:
    """Bytes a catalogue or Hub model's projector (`variant`: catalogue.Variant) will add once
    pulled: its recorded or listed size and, with `remote`, its encoder's compute from its header
    read from the Hub (the file's first bytes; its tensors give the size where none is recorded).
    Without that header only a known size is counted (the compute once the file is on disk)."""
    if variant is None:
        return 0
    size = variant.size or 0
    if remote and variant.sources:
        from localinfer.errors import LocalinferError
        from localinfer.models import hub
        try:
            header = hub.remote_file_header(variant.sources[0], variant.size)
        except LocalinferError:         # unreachable, or not a Hub file (a pip wheel)
            return size
        return (size or header.header_size + sum(t.n_bytes for t in header.tensors)) + \
            encoder_compute(header.metadata)
    return size


def encoder_compute(meta: dict) -> int:
    """The encoder's compute for one image or one audio window, from a projector's header."""
    return max(_compute(meta, "vision"), _compute(meta, "audio"))


def _compute(meta: dict, kind: str) -> int:
    if not meta.get(f"clip.has_{kind}_encoder"):
        return 0
    if kind == "vision":
        side = _int(meta, "clip.vision.image_size", 0) // max(1, _int(meta,
                                                                   "clip.vision.patch_size", 1))
        positions = side * side
    else:
        positions = _AUDIO_POSITIONS
    positions = min(positions, _MAX_POSITIONS)
    heads = _int(meta, f"clip.{kind}.attention.head_count", 1)
    width = max(_int(meta, f"clip.{kind}.embedding_length", 0),
                _int(meta, f"clip.{kind}.feed_forward_length", 0))
    return positions * positions * heads * 4 + positions * width * 4 * _ROWS


def _int(meta: dict, key: str, default: int) -> int:
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        return default
    return min(max(value, 0), 1 << 20)
