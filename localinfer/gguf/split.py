"""Split GGUF models: one model in N files named `PREFIX-0000K-of-0000N.gguf`, side by side.

llama.cpp loads such a model from its first part: it reads `split.count` from that part's header
and opens `PREFIX-00002-of-0000N.gguf` and the others beside it (llama_split_path's names).
The first part carries every metadata key and some tensors; the others carry only `split.*` keys
and their share of the tensors, each part a GGUF file of its own. So a check of a split model reads
every part's header before llama.cpp opens any, and what counts a model's bytes or tensors (memory
estimate, `info`, quantize plans) counts all parts.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from localinfer.gguf.header import CorruptFile, Header, check_tensors, read_header

SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
MAX_PARTS = 9999           # llama.cpp's names have five digits; no real model needs more
_NO, _COUNT, _TENSORS = "split.no", "split.count", "split.tensors.count"


def part_name(prefix: str, no: int, count: int) -> str:
    """The file name of part `no` (1-based) of `count`, as llama.cpp builds it."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def split_count(header: Header) -> int:
    """How many files the model is in: 1 for a whole file."""
    count = header.metadata.get(_COUNT, 0)
    if type(count) is not int or count < 0:
        raise CorruptFile(f"{_COUNT} is not a whole number")
    return max(count, 1)


def part_paths(path: Path, header: Header) -> list[Path]:
    """Every file of the model whose first file is `path` (with that header): `[path]` when whole.

    A split model's first part must be named as llama.cpp names it, with the count its header
    gives, or llama.cpp would look for other files than these."""
    count = split_count(header)
    if count == 1:
        return [Path(path)]
    if count > MAX_PARTS:
        raise CorruptFile(f"{_COUNT} is {count}, more than {MAX_PARTS} parts")
    match = SPLIT_NAME.fullmatch(Path(path).name)
    if match is None or int(match["no"]) != 1 or int(match["count"]) != count:
        raise CorruptFile(f"it is part of a model split in {count} files, and llama.cpp loads "
                          f"such a model from its first file, named {part_name('NAME', 1, count)}")
    return [Path(path).with_name(part_name(match["prefix"], k, count)) for k in range(1, count + 1)]


def check_parts(path: Path, first: Header) -> list[Header]:
    """The header of every other part of a split model, each read and checked as llama.cpp will
    read it (a CorruptFile naming the part otherwise); empty for a whole file.

    llama.cpp refuses a missing part or a malformed one cleanly, but asserts on a tensor with a
    zero dimension in any part, so every part's tensors are checked here; a part must be the
    part its name says, of the same model, and no tensor may appear in two parts."""
    paths = part_paths(path, first)
    if len(paths) == 1:
        return []
    _check_part(first, 0, len(paths), paths[0])
    names = {t.name for t in first.tensors}
    headers = []
    for no, part in enumerate(paths[1:], start=1):
        if not part.is_file():
            raise CorruptFile(f"part {no + 1} of {len(paths)}, {part.name}, is missing")
        header = read_header(part)
        _check_part(header, no, len(paths), part)
        check_tensors(header)
        repeated = names & {t.name for t in header.tensors}
        if repeated:
            raise CorruptFile(f"tensor {sorted(repeated)[0]} appears in two parts")
        names |= {t.name for t in header.tensors}
        headers.append(header)
    declared = first.metadata.get(_TENSORS)
    if declared is not None and declared != len(names):
        raise CorruptFile(f"its parts hold {len(names)} tensors, its header says {declared}")
    return headers


def _check_part(header: Header, no: int, count: int, path: Path) -> None:
    meta = header.metadata        # split.no counts from 0; the names and messages from 1
    if meta.get(_NO) != no or meta.get(_COUNT) != count:
        raise CorruptFile(f"{path.name} says it is part {_show(meta.get(_NO), 1)} of "
                          f"{_show(meta.get(_COUNT))}, not part {no + 1} of {count}")


def _show(value, add: int = 0) -> str:
    return str(value + add) if type(value) is int else "?"


def whole_model(path: Path, first: Header) -> tuple[Header, int]:
    """The first part's header with the tensors of every part, and the bytes of all parts: what
    counts a model's weights. Its header size is the first part's with the other parts' tensor
    descriptions added: the header of the model as one file (what the quantizer writes, less the
    split keys). Tensor offsets then no longer say where data is (each is from its own part's
    data section), so this is for counting only, never for reading tensor data."""
    others = check_parts(path, first)
    if not others:
        return first, Path(path).stat().st_size
    size = sum(p.stat().st_size for p in part_paths(path, first))
    more = [t for h in others for t in h.tensors]
    # A tensor's description: its name (u64 length, bytes), n_dims (u32), each dimension (u64),
    # its type (u32) and its offset (u64).
    described = sum(8 + len(t.name.encode()) + 4 + 8 * len(t.shape) + 4 + 8 for t in more)
    return replace(first, tensors=[*first.tensors, *more],
                   header_size=first.header_size + described), size
