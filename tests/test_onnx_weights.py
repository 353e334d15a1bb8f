"""GGUF blocks in MatMulNBits form: every carried format reproduces gguf's own dequantized values
(no second rounding), the others are re-quantized at 8 bits and say so, and damaged scales give
garbage weights rather than an exception."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from localinfer.backends.onnx import weights as onnx_weights
from localinfer.backends.onnx.export import unpermute_rows

pytest.importorskip("onnx")

# Byte ranges of each format's fp16 scale fields, set to finite values in random blocks.
_F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108]}


def random_tensor(type_name: str, rows: int, cols: int, seed: int = 0,
                  scale: float = 0.02) -> np.ndarray:
    """Random blocks of a format, valid apart from being random: finite scales up to `scale`."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in _F16_FIELDS.get(type_name, []):
        d = (rng.random(len(blocks)) * scale + scale / 20).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(type_name: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols).astype(np.float32)


@pytest.mark.parametrize("type_name", sorted(onnx_weights.CARRIED))
def test_carried_formats_are_exact(type_name):
    rows, cols = 48, 512
    raw = random_tensor(type_name, rows, cols)
    m = onnx_weights.matrix(type_name, raw, rows, cols)
    src_bits, block, bits = onnx_weights.CARRIED[type_name]
    assert (m.bits, m.block, m.exact) == (bits, block, True)
    assert m.codes.shape == (rows, cols // block, block * bits // 8)
    expected = reference(type_name, raw, rows, cols)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(onnx_weights.values(m), expected, rtol=0, atol=scale * 2e-7)
    # The symmetric formats need no offset term in the graph; the others do.
    assert (m.offsets is None) == (type_name in ("Q4_0", "Q5_0", "Q8_0", "Q6_K"))


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K"])
def test_other_formats_are_requantized_at_8_bits(type_name):
    rows, cols = 16, 512
    raw = random_tensor(type_name, rows, cols)
    m = onnx_weights.matrix(type_name, raw, rows, cols)
    assert (m.bits, m.block, m.exact, m.offsets) == (8, 32, False, None)
    expected = reference(type_name, raw, rows, cols)
    error = np.abs(onnx_weights.values(m) - expected).max()
    assert error <= np.abs(expected).max() / 127 / 2 * 1.01      # half an 8-bit step at most


def test_dense_formats_stay_dense():
    values = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    for type_name, raw in (("F32", values), ("F16", values.astype(np.float16))):
        m = onnx_weights.matrix(type_name, raw.view(np.uint8), 8, 64)
        assert m.bits == 0 and m.exact
        np.testing.assert_array_equal(m.dense, raw.astype(np.float32))
    f64 = onnx_weights.matrix("F64", values.astype(np.float64).view(np.uint8), 8, 64)
    np.testing.assert_array_equal(f64.dense, values)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    got = onnx_weights.vector("BF16", bf16.view(np.uint8), values.size)
    np.testing.assert_array_equal(got, (bf16.astype(np.uint32) << 16).view(np.float32).reshape(-1))


def test_row_slices_join_up(monkeypatch):
    """Large tensors are converted a slice of rows at a time: the result is the same."""
    raw = random_tensor("Q4_K", 40, 256, seed=3)
    whole = onnx_weights.matrix("Q4_K", raw, 40, 256)
    monkeypatch.setattr(onnx_weights, "ROW_SLICE", 16)
    sliced = onnx_weights.matrix("Q4_K", raw, 40, 256)
    for a, b in ((whole.codes, sliced.codes), (whole.scales, sliced.scales),
                 (whole.offsets, sliced.offsets)):
        np.testing.assert_array_equal(a, b)


def test_row_permutation_moves_whole_rows():
    raw = random_tensor("Q4_1", 64, 64, seed=2)
    m = onnx_weights.matrix("Q4_1", raw, 64, 64)
    order = unpermute_rows(n_head=2, head_dim=32)
    assert sorted(order.tolist()) == list(range(64))
    assert order[:4].tolist() == [0, 2, 4, 6] and order[16:18].tolist() == [1, 3]
    np.testing.assert_array_equal(onnx_weights.values(onnx_weights.take_rows(m, order)),
                                  onnx_weights.values(m)[order])


def test_damaged_scales_do_not_raise():
    raw = random_tensor("Q4_K", 4, 256, seed=4)
    blocks = raw.reshape(-1, 144)
    blocks[0, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
    blocks[1, 0:2] = np.array([np.inf], np.float16).view(np.uint8)
    blocks[2, 0:2] = 0
    m = onnx_weights.matrix("Q4_K", raw, 4, 256)
    assert m.codes.dtype == np.uint8 and m.codes.shape == (4, 8, 16)


def test_a_format_gguf_cannot_read_is_one_error():
    with pytest.raises(onnx_weights.UnreadableTensor, match="Q8_1"):
        onnx_weights.matrix("Q8_1", np.zeros((2, 40), np.uint8), 2, 32)
