"""Both graph forms compute the model exactly (accuracy level 0) on tiny llama and gemma3 files
holding every block format in every place: prefill, continuation and single-token steps, the
sliding window, the embedding gather and the tied head, against a float64 forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
from onnx_reference import Float64Model, kl  # noqa: E402
from onnx_tiny import write_tiny  # noqa: E402

from localinfer.backends.onnx import arch as onnx_arch, export as onnx_export, runner as onnx_runner  # noqa: E402
from localinfer.gguf.header import read_header  # noqa: E402

CARRIED = dict(embd="Q8_0", q="Q4_1", k="Q4_0", v="Q5_0", o="Q5_1", gate="Q4_K", up="Q5_K",
               down="Q6_K")
MODELS = {
    "llama": ("llama", CARRIED),
    # Q, K, V and gate, up with the same blocks: stacked into one matrix each, offsets mixed.
    "llama-stacked": ("llama", dict(embd="Q4_0", q="Q4_1", k="Q4_0", v="Q4_K", gate="Q4_0",
                                    up="Q4_K", down="Q8_0")),
    "llama-4bit-embedding": ("llama", dict(embd="Q4_1", q="F16", k="Q4_K", o="Q8_0")),
    "gemma3": ("gemma3", dict(embd="Q4_K", q="Q5_0", k="Q5_0", v="Q8_0", o="Q4_K", gate="Q5_0",
                              up="Q5_0", down="Q6_K")),
    "gemma3-dense-embedding": ("gemma3", dict(embd="F16", q="Q6_K", down="Q4_1")),
}
TOKENS = [int(t) for t in np.random.default_rng(1).integers(0, 512, 24)]   # window 8: it slides
SLOTS = 64


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request, tmp_path_factory):
    arch, types = MODELS[request.param]
    path = write_tiny(tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf", arch, types)
    header = read_header(path)
    spec = onnx_arch.read_spec(path, header)
    folder, index = onnx_export.ensure_weights(path, header, spec, path.parent / "onnx")
    return path, spec, folder, index, Float64Model(path).logits(TOKENS)


def _session(folder: Path, index, spec, form):
    import onnxruntime as ort
    graph = onnx_export.ensure_graph(folder, index, spec, form)
    return ort.InferenceSession(str(graph), onnx_runner.session_options(1))


def _assert_exact(got: np.ndarray, exact: np.ndarray) -> None:
    assert got.shape == exact.shape
    assert (got.argmax(-1) == exact.argmax(-1)).all()
    assert np.abs(got - exact).max() <= 2e-5 * np.abs(exact).max()
    assert kl(exact, got).mean() < 1e-9


def test_dynamic_graph_is_exact(tiny):
    path, spec, folder, index, exact = tiny
    if "stacked" in path.name:
        assert index.stacked([f"blk.0.attn_{w}.weight" for w in "qkv"])
        assert index.stacked(["blk.1.ffn_gate.weight", "blk.1.ffn_up.weight"])
    tables = onnx_runner.rope_tables(spec, SLOTS, None)
    runner = onnx_runner.DynamicRunner(_session(folder, index, spec, onnx_export.Form("dynamic", 0)),
                                       spec, SLOTS, tables)
    rows = [runner.run(TOKENS[:12], 0, 0).copy(), runner.run(TOKENS[12:18], 12, 0).copy()]
    rows += [runner.run([t], 18 + i, 0).copy() for i, t in enumerate(TOKENS[18:])]
    _assert_exact(np.concatenate(rows), exact)
    # logits_from: only the last row is computed, and it is the same row.
    last = runner.run(TOKENS[:20], 0, 19)
    np.testing.assert_allclose(last[0], exact[19], atol=2e-5 * np.abs(exact).max())


def test_static_graphs_are_exact(tiny):
    path, spec, folder, index, exact = tiny
    tables = onnx_runner.rope_tables(spec, SLOTS, None)
    prefill, decode = (_session(folder, index, spec, onnx_export.Form("static", 0, t, SLOTS))
                       for t in (8, 1))
    runner = onnx_runner.StaticRunner(prefill, decode, spec, 8, SLOTS, tables)
    rows = [runner.run(TOKENS[:13], 0, 0)]               # one full call and a padded one
    rows += [runner.run([t], 13 + i, 0) for i, t in enumerate(TOKENS[13:])]
    _assert_exact(np.concatenate(rows), exact)


def test_inexact_formats_are_listed_and_close(tmp_path):
    path = write_tiny(tmp_path / "k3.gguf", "llama", dict(k="Q3_K", v="Q2_K"))
    header = read_header(path)
    spec = onnx_arch.read_spec(path, header)
    folder, index = onnx_export.ensure_weights(path, header, spec, tmp_path / "onnx")
    assert index.inexact() == [f"blk.{i}.attn_{w}.weight" for i in (0, 1) for w in "kv"]
    runner = onnx_runner.DynamicRunner(_session(folder, index, spec, onnx_export.Form("dynamic", 0)),
                                       spec, SLOTS, onnx_runner.rope_tables(spec, SLOTS, None))
    exact = Float64Model(path).logits(TOKENS)
    assert kl(exact, runner.run(TOKENS, 0, 0)).mean() < 1e-4       # measured: 1.4e-5
