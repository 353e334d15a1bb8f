"""GGUF tensors to MLX arrays, for files `mx.load` refuses (any K-quant in them).

MLX's quantized layers hold, per group of 32 weights along a row, `w = scale * q + bias` with
unsigned `bits`-bit codes q. Most GGUF block formats have exactly that shape per 32 weights
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and Q4_K / Q5_K by sub-block), so those are carried over *exactly*:
the per-group scale and bias come from the block headers and the codes from the dequantized
values. `mx.quantize` on the dequantized values would instead pick its own grid and add a second
rounding as large as the first (relative error ~8% on a Q4_K tensor), which shows up as a KL of
several hundredths against llama.cpp. Formats that do not fit one group of 32 (Q6_K's 16-weight
sub-blocks, Q2_K, Q3_K, the IQ types) are dequantized with the `gguf` package and re-quantized
with `mx.quantize` at more bits than the source holds, so the added rounding stays small.
"""

from __future__ import annotations

import numpy as np

from localinfer.gguf import blocks as gguf_blocks

GROUP = 32                    # MLX group size used for every converted tensor

# GGUF type name -> bits for the re-quantized fallback: above the source's precision.
_FALLBACK_BITS = {"Q2_K": 4, "Q3_K": 4, "Q6_K": 8, "IQ4_NL": 6, "IQ4_XS": 6}
_DENSE = {"F32": np.float32, "F16": np.float16}


def convert_tensor(name: str, data: np.ndarray, type_name: str, shape: tuple[int, ...],
                   ) -> dict[str, np.ndarray]:
    """One GGUF tensor as MLX-ready arrays: {name: w} dense, or {w, scales, biases} quantized.

    `data` is the reader's raw array, `shape` the logical shape in MLX order (rows, columns).
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    base = name.removesuffix(".weight")
    if type_name in _DENSE:
        return {name: np.asarray(data).view(_DENSE[type_name]).reshape(shape)}
    if type_name == "BF16":
        bits = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        return {name: bits.view(np.float32).reshape(shape)}
    qtype = GGMLQuantizationType[type_name]
    if not is_groupable(shape):         # not a matrix MLX can quantize: keep it dense
        return {name: dequantize(np.asarray(data), qtype).reshape(shape)}
    bits, sub_block = gguf_blocks.GRIDS.get(type_name, (0, 0))
    if sub_block != GROUP:      # not a grid, or Q6_K's sub-blocks of 16: no MLX group holds it
        values = dequantize(np.asarray(data), qtype).reshape(shape)
        return _requantize(base, values, _FALLBACK_BITS.get(type_name, 8))
    grid = gguf_blocks.blocks(type_name, data)
    scales, biases = (a.reshape(shape[0], -1) for a in gguf_blocks.scale_and_bias(type_name, grid))
    if type_name == "Q8_0":     # the codes are the bytes themselves: skip the slow dequantize
        codes = gguf_blocks.q8_0_codes(grid).reshape(shape)
    else:
        values = dequantize(np.asarray(data), qtype).reshape(shape)
        codes = gguf_blocks.codes(values, scales, biases, GROUP, bits)
    return {f"{base}.weight": pack(codes, bits), f"{base}.scales": scales.astype(np.float16),
            f"{base}.biases": biases.astype(np.float16)}


def is_groupable(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and shape[-1] % GROUP == 0


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes (rows, cols) into MLX's uint32 words: a little-endian bit stream."""
    rows, cols = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes).view(np.uint32)
    if bits == 4:
        pairs = codes.reshape(rows, cols // 2, 2)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)).view(np.uint32)
    out = np.empty((rows, cols * bits // 32), dtype=np.uint32)
    for start in range(0, rows, 4096):       # the bit expansion is 8x the codes: do it in slices
        part = codes[start:start + 4096]
        stream = np.unpackbits(part[..., None], axis=-1, bitorder="little")[..., :bits]
        packed = np.packbits(stream.reshape(len(part), -1), axis=-1, bitorder="little")
        out[start:start + 4096] = packed.view(np.uint32)
    return out


def _requantize(base: str, values: np.ndarray, bits: int) -> dict[str, np.ndarray]:
    import mlx.core as mx
    w, scales, biases = mx.quantize(mx.array(values.astype(np.float32)), group_size=GROUP, bits=bits)
    return {f"{base}.weight": np.array(w), f"{base}.scales": np.array(scales.astype(mx.float16)),
            f"{base}.biases": np.array(biases.astype(mx.float16))}

