"""A multimodal model's projector (mmproj) file: where it is for a model file, found without
reading any file but names.

In the store a catalogue or Hub model's projector sits beside its quants as
`<name>-MMPROJ.gguf` (store.PROJECTOR). Beside a local .gguf anywhere else, the projector is the
one file of the folder whose name holds "mmproj" (as llama.cpp's downloads and the Hub name them);
with two or more, the one whose name shares the longest start with the model's after its
`mmproj` prefix, and none when that does not single one out (name it with --mmproj).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from localinfer.models.store import PROJECTOR

_MMPROJ = re.compile(r"mmproj", re.IGNORECASE)
_MAX_LISTED = 4096          # entries of a folder looked at (a home folder may hold many)


def is_projector_name(name: str) -> bool:
    return name.lower().endswith(".gguf") and _MMPROJ.search(name) is not None


def beside(model: Path) -> Path | None:
    """The projector for the model file `model`, or None."""
    folder = model.parent
    stored = folder / f"{folder.name}-{PROJECTOR}.gguf"
    if model.name.startswith(f"{folder.name}-") and stored.is_file():
        return stored
    found = _listed(folder)
    if len(found) <= 1:
        return found[0] if found else None
    stem = model.name.lower().removesuffix(".gguf")
    scored = sorted(((_shared(stem, _bare(p.name)), p) for p in found), reverse=True)
    best, runner_up = scored[0][0], scored[1][0]
    return scored[0][1] if best > runner_up and best > 0 else None


def _listed(folder: Path) -> list[Path]:
    out = []
    try:
        with os.scandir(folder) as entries:
            for k, entry in enumerate(entries):
                if k >= _MAX_LISTED:
                    break
                if is_projector_name(entry.name) and entry.is_file():
                    out.append(Path(entry.path))
    except OSError:
        return []
    return sorted(out)


def _bare(name: str) -> str:
    """A projector's name without its mmproj marker and separators: what names its model."""
    return _MMPROJ.sub("", name.lower().removesuffix(".gguf")).strip("-_. ")


def _shared(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
