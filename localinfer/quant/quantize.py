"""Quantize a GGUF model with llama.cpp's own quantizer, writing atomically.

`plan` runs llama.cpp's dry run, which decides every tensor's target type exactly as the real run
will (K-quant mixes keep some tensors at higher precision), and turns those decisions into the exact
size of the file: `quantize --dry-run` and auto-fit use it. `quantize_file` does without it, to cost
no more than `llama-quantize`: the disk-space check uses a bound read from the header (the exact
plan only when the bound does not fit), and llama.cpp's own refusals (an importance matrix needed,
requantizing not allowed) come back as our one-line errors. It writes to a temporary name beside
the destination and renames it into place only when complete.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from localinfer.errors import LocalinferError, UsageError
from localinfer.gguf import split as gguf_split
from localinfer.gguf.checks import checked_header
from localinfer.gguf.header import BLOCK_SIZES, Header, read_header
from localinfer.models.store import temp_path, to_safe_name

if TYPE_CHECKING:       # the imatrix module needs numpy; a quantization without one does not
    from localinfer.quant.imatrix import Imatrix

# llama_ftype of every target llama-quantize offers (its QUANT_OPTIONS), best quality first.
QUANT_TYPES: dict[str, int] = {
    "F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q5_K_S": 16, "Q5_1": 9,
    "Q5_0": 8, "Q4_K_M": 15, "Q4_K_S": 14, "Q4_1": 3, "IQ4_NL": 25, "Q4_0": 2, "IQ4_XS": 30,
    "Q3_K_L": 13, "Q3_K_M": 12, "IQ3_M": 27, "IQ3_S": 26, "Q3_K_S": 11, "IQ3_XS": 22,
    "IQ3_XXS": 23, "Q2_K": 10, "Q2_K_S": 21, "IQ2_M": 29, "IQ2_S": 28, "IQ2_XS": 20,
    "IQ2_XXS": 19, "IQ1_M": 31, "IQ1_S": 24, "TQ2_0": 37, "TQ1_0": 36, "Q2_0": 41, "Q1_0": 40,
    "MXFP4_MOE": 38,
}
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "FP16": "F16", "FP32": "F32"}
# Source tensors in these types are not quantized: converting them loses nothing worth a warning.
UNQUANTIZED = {"F32", "F16", "BF16", "F64"}

Progress = Callable[[int, int, str], None]      # (tensors done, tensors in all, tensor name)


def parse_type(name: str) -> str:
    """A canonical type name ('q4_k' → 'Q4_K_M'); a UsageError listing the valid ones otherwise."""
    key = name.strip().upper().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in QUANT_TYPES:
        raise UsageError(f"unknown quantization type '{name}'; valid types: {', '.join(QUANT_TYPES)}")
    return key


@dataclass(frozen=True)
class TensorPlan:
    name: str
    source_type: str         # gguf's names: Q4_K, F16, ...
    target_type: str
    size: int                # bytes in the output, before alignment padding


@dataclass(frozen=True)
class QuantPlan:
    """What a quantization will produce, decided by llama.cpp's dry run."""

    qtype: str
    tensors: list[TensorPlan]
    file_size: int           # exact size of the output file
    needs_imatrix: bool

    @property
    def requantized_types(self) -> list[str]:
        """Quantized source types that would be converted again (compounding rounding error)."""
        return sorted({t.source_type for t in self.tensors
                       if t.source_type != t.target_type and t.source_type not in UNQUANTIZED})


# -- planning --------------------------------------------------------------------------------------
# "[  12/ 272]  blk.0.attn_k.weight  - [  576,   192,     1,     1], type =   q4_1, size = ... (q8_0)"
_TENSOR_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+),(.*)$")
_TARGET = re.compile(r"->.*\((\w+)\)\s*$")


def plan(src: Path, qtype: str, *, imatrix: Imatrix | None = None) -> QuantPlan:
    """Exact outcome of quantizing `src` to `qtype`, without writing anything."""
    from localinfer.backends.llama import quantize as llama_quantize
    # What the quantizer would abort on, refused first; a split model's tensors are in all parts.
    header, _ = gguf_split.whole_model(src, checked_header(src))
    targets: dict[str, str] = {}
    needs_imatrix = [False]

    def on_line(line: str) -> None:
        match = _TENSOR_LINE.match(line.strip())
        if match:
            target = _TARGET.search(match.group(5))
            targets[match.group(3)] = (target.group(1) if target else match.group(4)).upper()
        elif "will require an imatrix" in line:
            needs_imatrix[0] = True

    call = llama_quantize.QuantizeCall(src, None, QUANT_TYPES[qtype], allow_requantize=True,
                                       imatrix=imatrix.data if imatrix else None)
    llama_quantize.quantize(call, on_line, dry_run=True)
    tensors = [_tensor_plan(t, targets.get(t.name, t.type_name)) for t in header.tensors]
    size = output_size(header, [t.size for t in tensors], _extra_kv(imatrix))
    return QuantPlan(qtype, tensors, size, needs_imatrix[0] and imatrix is None)


def _tensor_plan(tensor, target: str) -> TensorPlan:
    block, block_bytes = BLOCK_SIZES[target]
    return TensorPlan(tensor.name, tensor.type_name, target, tensor.n_elements // block * block_bytes)


def _extra_kv(imatrix: Imatrix | None) -> list[tuple[str, int | str]]:
    return imatrix.kv_overrides(str(imatrix.path)) if imatrix else []


def size_bound(header: Header, qtype: str, imatrix: Imatrix | None = None) -> int:
    """At least the size of the file `quantize_file` will write, from the header alone.

    A tensor llama.cpp leaves alone keeps its bytes; one it converts gets at most 8.5 bits per
    weight for a quantized target (Q8_0 is the largest type any mix assigns), or F16 where its
    rows do not split into 32-weight blocks (llama.cpp's last fallback), or the float target's own.
    """
    per_weight = {"F32": 4.0, "F16": 2.0, "BF16": 2.0}.get(qtype)

    def bound(t) -> int:
        weight_bytes = per_weight or (34 / 32 if t.shape and t.shape[0] % 32 == 0 else 2.0)
        return max(t.n_bytes, math.ceil(t.n_elements * weight_bytes))
    return output_size(header, [bound(t) for t in header.tensors], _extra_kv(imatrix))


def output_size(header: Header, tensor_sizes: list[int],
                extra_kv: list[tuple[str, int | str]]) -> int:
    """Bytes of the file llama.cpp writes: the input's header with its own keys set, then every
    tensor padded to the alignment."""
    align = int(header.metadata.get("general.alignment", 32))
    meta = header.header_size
    for key in ("general.quantization_version", "general.file_type"):
        if key not in header.metadata:
            meta += _kv_bytes(key, 0)
    for key, size in (("split.no", 2), ("split.count", 2), ("split.tensors.count", 4)):
        if key in header.metadata:
            meta -= 8 + len(key.encode()) + 4 + size
    for key, value in extra_kv:
        if key not in header.metadata:
            meta += _kv_bytes(key, value)
    return _pad(meta, align) + sum(_pad(size, align) for size in tensor_sizes)


def _kv_bytes(key: str, value: int | str) -> int:
    body = 4 if isinstance(value, int) else 8 + len(value.encode()[:127])   # u32, or a string
    return 8 + len(key.encode()) + 4 + body


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


# -- quantizing ------------------------------------------------------------------------------------
def quantize_file(src: Path, dst: Path, qtype: str, *, threads: int = 0,
                  allow_requantize: bool = False, imatrix: Imatrix | None = None,
                  progress: Progress | None = None, force: bool = False,
                  warn: Callable[[str], None] = lambda _: None) -> int:
    """Quantize `src` into `dst` (atomically); return the size of the file written.

    For other modules too (auto-fit, a same-model draft for speculative decoding): `qtype` is any
    name `parse_type` accepts.
    """
    qtype = parse_type(qtype)
    src, dst = Path(src), Path(dst)
    # A clear line for a damaged input, before llama.cpp aborts on it; all parts of a split model.
    header, _ = gguf_split.whole_model(src, checked_header(src))
    _check_paths(src, dst, force=force)
    if imatrix is not None:
        check_imatrix(imatrix, header)
    quantized = quantized_types(header)
    _check_space_for(src, dst.parent, header, qtype, imatrix)
    _write(src, dst, qtype, threads=threads, allow_requantize=allow_requantize, imatrix=imatrix,
           progress=progress, quantized=quantized)
    if quantized and qtype not in UNQUANTIZED:   # said once the result exists, not before a refusal
        warn(f"the source was already quantized ({', '.join(quantized)}): requantizing compounds "
             "the rounding error; the result is worse than quantizing the original weights")
    return dst.stat().st_size


def quantized_types(header: Header) -> list[str]:
    """The quantized tensor types of a model (what llama.cpp would requantize)."""
    return sorted({t.type_name for t in header.tensors if t.type_name not in UNQUANTIZED})


def _check_paths(src: Path, dst: Path, *, force: bool) -> None:
    if dst.exists() and not force:
        raise UsageError(f"{dst} already exists; pass --force to replace it")
    if dst.exists() and src.resolve() == dst.resolve():
        raise UsageError("the output would overwrite the input; choose another -o")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LocalinferError(f"cannot create {dst.parent}: {e.strerror}") from e
    if not os.access(dst.parent, os.W_OK):
        raise LocalinferError(f"cannot write to {dst.parent}: permission denied")


def _check_space_for(src: Path, folder: Path, header: Header, qtype: str,
                     imatrix: Imatrix | None) -> None:
    """Refuse before writing when the result cannot fit on the disk. The header's bound settles it
    almost always; only when the bound does not fit is the exact size worth a dry run."""
    if shutil.disk_usage(folder).free >= size_bound(header, qtype, imatrix):
        return
    check_space(folder, plan(src, qtype, imatrix=imatrix).file_size)


def check_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise LocalinferError(f"not enough disk space: the result needs {needed / 1e6:.0f} MB, "
                              f"{free / 1e6:.0f} MB are free under {folder}")


def check_imatrix(imatrix: Imatrix, header: Header) -> None:
    """An imatrix made for another model would be silently ignored or fail halfway: refuse early."""
    by_name = {t.name: t for t in header.tensors}
    matched = [name for name in imatrix.data if name in by_name]
    if not matched:
        raise UsageError(f"{imatrix.path.name} does not match this model: none of its "
                         f"{len(imatrix.data)} entries names one of the model's tensors")
    for name in matched:
        shape = by_name[name].shape
        expected = shape[0] * (shape[2] if len(shape) > 2 else 1)
        if imatrix.data[name].size != expected and "token_embd" not in name:
            raise UsageError(f"{imatrix.path.name} does not match this model: {name} has "
                             f"{imatrix.data[name].size} values, the tensor needs {expected}")


def _write(src: Path, dst: Path, qtype: str, *, threads: int, allow_requantize: bool,
           imatrix: Imatrix | None, progress: Progress | None, quantized: list[str]) -> None:
    from localinfer.backends.llama import quantize as llama_quantize
    from localinfer.machine import default_threads
    tmp = temp_path(dst)       # a leftover of a killed run is swept by store_sweep

    def on_line(line: str) -> None:
        match = _TENSOR_LINE.match(line.strip())
        if match and progress:
            progress(int(match.group(1)), int(match.group(2)), match.group(3))

    call = llama_quantize.QuantizeCall(
        # 0 is run's meaning (a thread per physical core we may use), not llama.cpp's (every
        # hardware thread); the file written is the same either way.
        src, tmp, QUANT_TYPES[qtype], threads=threads or default_threads(), allow_requantize=allow_requantize,
        imatrix=imatrix.data if imatrix else None, kv_overrides=_extra_kv(imatrix))
    try:
        llama_quantize.quantize(call, on_line)
        os.replace(tmp, dst)
    except llama_quantize.QuantizeFailed as e:
        tmp.unlink(missing_ok=True)
        refusal = _refusal(e.reason, qtype, quantized)
        if refusal is None:
            raise
        raise refusal from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _refusal(reason: str, qtype: str, quantized: list[str]) -> UsageError | None:
    """llama.cpp's refusals of a request, in our words: what is wrong and what to do."""
    if "requires an imatrix" in reason:
        return UsageError(f"{qtype} needs an importance matrix: pass --imatrix FILE "
                          "(made by llama.cpp's llama-imatrix on this model)")
    if "requantizing from type" in reason:
        return UsageError(f"the source is already quantized ({', '.join(quantized)}); quantizing "
                          "it again compounds the rounding error. Start from an F16/F32 file, or "
                          "pass --allow-requantize to do it anyway")
    return None


# -- where from, where to --------------------------------------------------------------------------
# Highest precision first: the best source to quantize from when a model has several on disk.
PRECISION_ORDER = ("F32", "F16", "BF16", *[t for t in QUANT_TYPES if t not in ("F32", "F16", "BF16")])
_QUANT_SUFFIX = re.compile(r"[.\-_](" + "|".join(sorted(QUANT_TYPES, key=len, reverse=True))
                           + r")$", re.IGNORECASE)


def store_name_for(path: Path) -> str:
    """The store name for a model given as a file: its stem without a quant suffix, lower case,
    other characters than the safe-name rule allows turned into '-'."""
    split = gguf_split.SPLIT_NAME.fullmatch(path.name)     # a split model's first part
    stem = split["prefix"] if split else path.stem
    name = to_safe_name(_QUANT_SUFFIX.sub("", stem)) or to_safe_name(stem)
    if not name:
        raise UsageError(f"cannot make a model name from {path.name!r}; "
                         "rename the file or pass -o to write elsewhere")
    return name


def best_on_disk(quants: list[str]) -> str | None:
    """The most precise of the quants present (unknown names rank last)."""
    ranked = sorted(quants, key=lambda q: PRECISION_ORDER.index(q) if q in PRECISION_ORDER else 99)
    return ranked[0] if ranked else None
