"""GGUF weight matrices in ONNX Runtime's MatMulNBits layout, carried over without re-rounding.

MatMulNBits (com.microsoft) computes y = x @ W^T with each row of W held in blocks of `block`
weights as w = scale * (code - zero), codes of 4 or 8 bits, zero = 2^(bits-1) (no zero-point
input: the fast kernels). Every GGUF block format read here is w = scale * q + bias per sub-block
(32 weights, 16 for Q6_K) with an unsigned q of `src_bits` bits, so it maps exactly onto

    code = q + zero - 2^(src_bits-1),   w = scale * (code - zero) + offset,
    offset = bias + 2^(src_bits-1) * scale,

where offset is 0 for the symmetric formats (Q4_0, Q5_0, Q8_0, Q6_K). For the others (Q4_1, Q5_1,
Q4_K, Q5_K) the graph adds each block's input sum times the block's offset (see graph.py):
exact, and MatMulNBits stays on its fast path (float zero points take one 30-60x slower). 4-bit
sources keep 4-bit codes; 5- and 6-bit ones get 8-bit codes (ORT has 2, 4 and 8 bits only).
Other formats (Q2_K, Q3_K, the IQ types) are dequantized with `gguf` and quantized at 8 bits per
32 weights, more precision than they hold, and marked inexact. F32/F16/BF16/F64: dense float32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from localinfer.gguf import blocks as gguf_blocks
from localinfer.gguf.blocks import GRIDS

ROW_SLICE = 4096              # rows converted at a time: bounds the float32 temporaries

# GGUF type -> (source bits, sub-block, target bits): 4-bit grids keep 4-bit codes, the others
# take 8 (MatMulNBits has 2, 4 and 8 bits only).
CARRIED = {name: (bits, sub, 4 if bits == 4 else 8) for name, (bits, sub) in GRIDS.items()}
DENSE = ("F32", "F16", "BF16", "F64")
FALLBACK_BITS, FALLBACK_BLOCK = 8, 32


class UnreadableTensor(ValueError):
    """A tensor type this module cannot turn into weights (the message names the type)."""


@dataclass(frozen=True)
class Matrix:
    """One weight matrix W (rows x cols), used as y = x @ W^T: MatMulNBits blocks or dense."""

    rows: int
    cols: int
    bits: int                          # 4 or 8: MatMulNBits; 0: dense
    block: int
    codes: np.ndarray | None = None    # uint8 [rows, cols // block, block * bits // 8]
    scales: np.ndarray | None = None   # float32 [rows, cols // block]
    offsets: np.ndarray | None = None  # float32 [rows, cols // block]; None when all zero
    dense: np.ndarray | None = None    # float32 [rows, cols]
    exact: bool = True


def matrix(type_name: str, raw: np.ndarray, rows: int, cols: int) -> Matrix:
    """The matrix stored in `raw` (the tensor's bytes, one row of W per row of `raw`)."""
    raw = np.asarray(raw).view(np.uint8).reshape(rows, -1)
    if type_name in DENSE:
        return Matrix(rows, cols, 0, 0, dense=vector(type_name, raw, rows * cols).reshape(rows, cols))
    parts = [_convert_rows(type_name, raw[start:start + ROW_SLICE], cols)
             for start in range(0, rows, ROW_SLICE)]
    codes = np.concatenate([p[0] for p in parts])
    scales = np.concatenate([p[1] for p in parts])
    offsets = None if parts[0][2] is None else np.concatenate([p[2] for p in parts])
    bits, block, exact = parts[0][3]
    if offsets is not None and not offsets.any():
        offsets = None
    return Matrix(rows, cols, bits, block, codes, scales, offsets, exact=exact)


def vector(type_name: str, raw: np.ndarray, n: int) -> np.ndarray:
    """A 1-D tensor (norm weights, rope factors) as float32."""
    data = np.asarray(raw).view(np.uint8).reshape(-1)
    if type_name == "F32":
        return data.view(np.float32)[:n].copy()
    if type_name == "F16":
        return data.view(np.float16)[:n].astype(np.float32)
    if type_name == "BF16":
        return (data.view(np.uint16)[:n].astype(np.uint32) << 16).view(np.float32)
    if type_name == "F64":
        return data.view(np.float64)[:n].astype(np.float32)
    return _dequantize(type_name, data.reshape(1, -1)).reshape(-1)[:n]


def take_rows(m: Matrix, order: np.ndarray) -> Matrix:
    """The same matrix with its rows reordered (every per-row array moves together: exact)."""
    def pick(a):
        return None if a is None else np.ascontiguousarray(a[order])
    return replace(m, codes=pick(m.codes), scales=pick(m.scales), offsets=pick(m.offsets),
                   dense=pick(m.dense))


def stack_rows(parts: list[Matrix]) -> Matrix | None:
    """The matrices one under another (one MatMulNBits for Q, K and V, or gate and up), or None
    when their blocks differ. Exact: each output column still reads only its own row."""
    first = parts[0]
    if any((m.bits, m.block, m.cols) != (first.bits, first.block, first.cols) for m in parts):
        return None
    if first.bits == 0:
        return Matrix(sum(m.rows for m in parts), first.cols, 0, 0,
                      dense=np.concatenate([m.dense for m in parts]))
    offsets = None
    if any(m.offsets is not None for m in parts):
        offsets = np.concatenate([m.offsets if m.offsets is not None else np.zeros_like(m.scales)
                                  for m in parts])
    return Matrix(sum(m.rows for m in parts), first.cols, first.bits, first.block,
                  np.concatenate([m.codes for m in parts]),
                  np.concatenate([m.scales for m in parts]), offsets,
                  exact=all(m.exact for m in parts))


def values(m: Matrix) -> np.ndarray:
    """W as float32, computed the way the graph does (for tests and the embedding's reference)."""
    if m.bits == 0:
        return m.dense
    codes = unpack(m.codes, m.bits).astype(np.float32) - (1 << (m.bits - 1))
    w = codes * m.scales[..., None]
    if m.offsets is not None:
        w = w + m.offsets[..., None]
    return w.reshape(m.rows, m.cols)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits bytes back into one code per weight: [rows, blocks, block]."""
    if bits == 8:
        return packed
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


# -- conversion ------------------------------------------------------------------------------------
def _convert_rows(type_name: str, raw: np.ndarray, cols: int):
    """(codes, scales, offsets, (bits, block, exact)) of a slice of rows."""
    if type_name not in CARRIED:
        return (*_requantize(_dequantize(type_name, raw)), (FALLBACK_BITS, FALLBACK_BLOCK, False))
    src_bits, block, bits = CARRIED[type_name]
    rows = raw.shape[0]
    grid = gguf_blocks.blocks(type_name, raw)
    headers = gguf_blocks.scale_and_bias(type_name, grid)
    scale, bias = (a.reshape(rows, cols // block) for a in headers)
    if type_name == "Q8_0":       # the codes are the bytes themselves: no dequantize
        q = gguf_blocks.q8_0_codes(grid).reshape(rows, -1)
    else:
        q = gguf_blocks.codes(_dequantize(type_name, raw), scale, bias, block, src_bits)
    half = 1 << (src_bits - 1)
    codes = q + np.uint8((1 << (bits - 1)) - half)
    offsets = bias + np.float32(half) * scale
    return _pack(codes, bits, block), scale, offsets.astype(np.float32), (bits, block, True)


def _requantize(v: np.ndarray):
    """Symmetric 8-bit codes per 32 weights, for formats MatMulNBits cannot hold as they are."""
    rows = v.shape[0]
    grouped = np.nan_to_num(v.reshape(rows, -1, FALLBACK_BLOCK), nan=0.0, posinf=0.0, neginf=0.0)
    scale = (np.abs(grouped).max(axis=-1) / 127).astype(np.float32)
    safe = np.where(scale == 0, 1, scale)[..., None]
    codes = (np.clip(np.rint(grouped / safe), -127, 127) + 128).astype(np.uint8)
    return _pack(codes.reshape(rows, -1), FALLBACK_BITS, FALLBACK_BLOCK), scale, None


def _pack(codes: np.ndarray, bits: int, block: int) -> np.ndarray:
    rows = codes.shape[0]
    if bits == 4:       # two codes a byte, the even-numbered weight in the low nibble
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return np.ascontiguousarray(codes.reshape(rows, -1, block * bits // 8))


def _dequantize(type_name: str, raw: np.ndarray) -> np.ndarray:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    try:
        qtype = GGMLQuantizationType[type_name]
        with np.errstate(all="ignore"):
            out = dequantize(np.ascontiguousarray(raw), qtype)
    except (KeyError, NotImplementedError) as e:
        raise UnreadableTensor(f"{type_name} weights") from e
    return out.astype(np.float32).reshape(raw.shape[0], -1)

