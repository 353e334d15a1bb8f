"""GGUF's quantized block formats read as grids: per sub-block, w = scale * q + bias, q unsigned.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K (sub-blocks of 32) and Q6_K (of 16) all have that shape,
so a backend whose own quantized layout is a grid per group (MLX, ONNX Runtime's MatMulNBits)
can carry their weights over without a second rounding: the scale and bias come from the block
headers read here, the codes from the values dequantized on that grid. The other formats (Q2_K,
Q3_K, the IQ types) are not grids of this kind; callers dequantize and re-quantize them.
"""

from __future__ import annotations

import numpy as np

from localinfer.gguf.header import BLOCK_SIZES

# GGUF type -> (bits of q, weights per sub-block): the formats read as grids.
GRIDS: dict[str, tuple[int, int]] = {
    "Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (5, 32), "Q5_1": (5, 32), "Q8_0": (8, 32),
    "Q4_K": (4, 32), "Q5_K": (5, 32), "Q6_K": (6, 16),
}


def blocks(type_name: str, raw: np.ndarray) -> np.ndarray:
    """A tensor's bytes as rows of one block each."""
    _, size = BLOCK_SIZES[type_name]
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)


def scale_and_bias(type_name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block, each sub-block's (scale, bias) as float32: w = scale * q + bias."""
    return _HEADERS[type_name](rows)


def q8_0_codes(rows: np.ndarray) -> np.ndarray:
    """Q8_0's q, the block's int8 bytes shifted to unsigned: no dequantize needed."""
    return (rows[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)


def codes(values: np.ndarray, scale: np.ndarray, bias: np.ndarray, sub_block: int,
          bits: int) -> np.ndarray:
    """Each weight's q on its sub-block's grid (exact: the values were made from it); values are
    (rows, cols), scale and bias (rows, cols // sub_block)."""
    rows = values.shape[0]
    grouped = values.reshape(rows, -1, sub_block)
    step = scale[..., None]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        q = np.rint((grouped - bias[..., None]) / np.where(step == 0, 1, step))
    # A zero, infinite or NaN scale (a damaged file) gives garbage weights, as in llama.cpp,
    # never an invalid cast.
    q = np.nan_to_num(np.where(step == 0, 0, q), nan=0.0, posinf=0.0, neginf=0.0)
    return np.clip(q, 0, (1 << bits) - 1).astype(np.uint8).reshape(rows, -1)


# -- the block headers -----------------------------------------------------------------------------
def _f16(rows: np.ndarray, at: int) -> np.ndarray:
    return rows[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _symmetric(half: int):
    """Q4_0 / Q5_0 / Q8_0: w = d * (q - half), one fp16 d per block of 32."""
    def read(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d = _f16(rows, 0)
        return d, -np.float32(half) * d
    return read


def _with_min(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_1 / Q5_1: w = d * q + m."""
    return _f16(rows, 0), _f16(rows, 2)


def _k_quant(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 8 sub-blocks of 32, w = (d * sc_j) * q - dmin * m_j, as ggml computes it."""
    from gguf.quants import Q4_K      # its 6-bit unpacking of sc_j and m_j
    d, dmin = _f16(rows, 0), _f16(rows, 2)
    sc, m = Q4_K.get_scale_min(rows[:, 4:4 + Q4_K.K_SCALE_SIZE].copy())
    return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * m.astype(np.float32))


def _q6_k(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: 16 sub-blocks of 16, w = (d * sc_j) * (q - 32) with int8 sc_j (bytes 192..207)."""
    scale = _f16(rows, 208)[:, None] * rows[:, 192:208].view(np.int8).astype(np.float32)
    return scale, -np.float32(32) * scale


_HEADERS = {
    "Q4_0": _symmetric(8), "Q5_0": _symmetric(16), "Q8_0": _symmetric(128),
    "Q4_1": _with_min, "Q5_1": _with_min, "Q4_K": _k_quant, "Q5_K": _k_quant, "Q6_K": _q6_k,
}
