"""Running an exported graph on ONNX Runtime: inputs, KV buffers, rope tables, logits.

Both runners keep each layer's K and V in a numpy array [1, n_kv, capacity, head_dim] that the
session reads (and, for the dynamic graph, writes) in place, so the KV cache is plain host memory:
trimming is a change of n_past, and state/restore copy rows. Rope tables are computed here in
float64 from llama.cpp's definition and handed to the graph as inputs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localinfer.backends.onnx.arch import Spec
from localinfer.backends.onnx.forms import kv_outputs, layer_kinds, mask_inputs

MASKED = -1e30                 # additive mask: finite, so a fully masked padding row stays finite


def rope_tables(spec: Spec, n_positions: int, factors: np.ndarray | None) -> dict[str, np.ndarray]:
    """cos/sin [positions, head_dim/2] for each kind of layer the model has (global, local).

    theta = position * scale * base^(-2i/head_dim) / factor_i, as llama.cpp's rope (its freq
    factors are Llama 3's rope_freqs; sliding-window layers use their own base and no scaling).
    """
    tables = {}
    bases = {"global": (spec.rope_base, spec.rope_scale, factors),
             "local": (spec.local_rope_base, 1.0, None)}
    bases = [(kind, *bases[kind]) for kind in layer_kinds(spec)]
    dims = np.arange(0, spec.head_dim, 2, dtype=np.float64) / spec.head_dim
    positions = np.arange(n_positions, dtype=np.float64)
    for name, base, scale, ff in bases:
        inv = base ** -dims
        if ff is not None:
            inv = inv / ff.astype(np.float64)
        angle = np.outer(positions * scale, inv)
        tables[f"cos_{name}"] = np.cos(angle).astype(np.float32)
        tables[f"sin_{name}"] = np.sin(angle).astype(np.float32)
    return tables


def session_options(threads: int, extra: dict[str, str] | None = None):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3          # errors only: ORT's warnings are not for our users
    for key, value in (extra or {}).items():
        so.add_session_config_entry(key, value)
    return so


def _kv_buffers(spec: Spec, capacity: int) -> list[np.ndarray]:
    shape = (1, spec.n_kv, capacity, spec.head_dim)
    try:
        return [np.zeros(shape, np.float32) for _ in range(2 * spec.n_layer)]
    except MemoryError:
        from localinfer.errors import ModelLoadError
        need = 2 * spec.n_layer * spec.n_kv * capacity * spec.head_dim * 4
        raise ModelLoadError(f"a float32 KV cache of {capacity} tokens needs {need / 2**30:.1f} "
                             "GiB, more than this machine can give; lower --ctx") from None


class DynamicRunner:
    """The dynamic graph: past and present K/V bound to the same buffers, written in place."""

    def __init__(self, session, spec: Spec, capacity: int, tables: dict[str, np.ndarray]) -> None:
        import onnxruntime as ort
        self._ort, self._session, self.spec, self.capacity = ort, session, spec, capacity
        self.buffers = _kv_buffers(spec, capacity)
        self._io = session.io_binding()
        # The logits are bound first, so get_outputs()[0] is always them.
        self._io.bind_output("logits")
        for past, present, buf in zip(kv_outputs(spec, "past"), kv_outputs(spec, "present"),
                                      self.buffers):
            value = ort.OrtValue.ortvalue_from_numpy(buf)       # wraps buf: no copy
            self._io.bind_ortvalue_input(past, value)
            self._io.bind_ortvalue_output(present, value)
        self._keep = [tables]          # bound inputs must outlive the binding
        for name, table in tables.items():
            self._io.bind_cpu_input(name, table)
        # A one-row logits output lands in this array (decode: no allocation per token).
        self._row = np.empty((1, 1, spec.n_vocab), np.float32)
        self._row_value = ort.OrtValue.ortvalue_from_numpy(self._row)

    def run(self, tokens: Sequence[int], n_past: int, logits_from: int) -> np.ndarray:
        """Evaluate tokens at positions n_past...; logits [rows, n_vocab] from row logits_from."""
        n = len(tokens)
        io = self._io
        io.bind_cpu_input("input_ids", np.asarray(tokens, dtype=np.int64).reshape(1, n))
        io.bind_cpu_input("seqlens_k", np.array([n_past + n - 1], np.int32))
        io.bind_cpu_input("total_sequence_length", np.array(n_past + n, np.int32))
        io.bind_cpu_input("logits_from", np.array([logits_from], np.int64))
        if n - logits_from == 1:
            io.bind_ortvalue_output("logits", self._row_value)
        else:                           # its shape changes with the call: bound anew each time
            io.bind_output("logits")
        self._session.run_with_iobinding(io)
        if n - logits_from == 1:
            return self._row[0]
        return io.get_outputs()[0].numpy()[0]


class StaticRunner:
    """The static graphs: a prefill shape (T tokens a call) and a decode shape (one token), the
    cache owned here and passed whole to each call with an additive mask."""

    def __init__(self, prefill, decode, spec: Spec, tokens: int, slots: int,
                 tables: dict[str, np.ndarray]) -> None:
        import onnxruntime as ort
        self.spec, self.tokens, self.capacity = spec, tokens, slots
        self.buffers = _kv_buffers(spec, slots)
        self._tables = tables
        self._shapes = {}
        for session, t in ((prefill, tokens), (decode, 1)):
            io = session.io_binding()
            new = [np.zeros((1, spec.n_kv, t, spec.head_dim), np.float32) for _ in self.buffers]
            for name, buf in zip(kv_outputs(spec, "past"), self.buffers):
                io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(buf))
            for name, buf in zip(kv_outputs(spec, "new"), new):
                io.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(buf))
            logits = np.empty((1, t, spec.n_vocab), np.float32)
            io.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
            self._shapes[t] = (session, io, new, logits)

    def run(self, tokens: Sequence[int], n_past: int, logits_from: int) -> np.ndarray:
        if len(tokens) == 1:
            return self._call(1, tokens, n_past)[logits_from:].copy()
        rows = []
        for start in range(0, len(tokens), self.tokens):
            chunk = tokens[start:start + self.tokens]
            out = self._call(self.tokens, chunk, n_past + start)
            rows.append(out[:len(chunk)].copy())
        return np.concatenate(rows)[logits_from:]

    def _call(self, t: int, chunk: Sequence[int], n_past: int) -> np.ndarray:
        """One call of the t-token graph; the chunk is padded to t, padding rows discarded."""
        session, io, new, logits = self._shapes[t]
        n = len(chunk)
        ids = np.zeros((1, t), np.int64)
        ids[0, :n] = chunk
        io.bind_cpu_input("input_ids", ids)
        positions = np.full(t, n_past + n - 1)
        positions[:n] = np.arange(n_past, n_past + n)
        for name in self._tables:
            half = self._tables[name][positions]
            io.bind_cpu_input(name, np.concatenate([half, half], axis=-1)[None])
        for name in mask_inputs(self.spec):
            window = self.spec.window if name == "attn_mask_local" else 0
            io.bind_cpu_input(name, self._mask(t, n_past, window))
        session.run_with_iobinding(io)
        for buf, rows in zip(self.buffers, new):
            buf[:, :, n_past:n_past + n] = rows[:, :, :n]
        return logits[0]

    def _mask(self, t: int, n_past: int, window: int) -> np.ndarray:
        """Query row r (position n_past + r) sees cached slots below n_past and new rows up to r,
        within `window` positions when that is set (llama.cpp: p_query - p_key < window)."""
        query = n_past + np.arange(t)[:, None]
        key = np.concatenate([np.arange(self.capacity), n_past + np.arange(t)])[None, :]
        seen = key <= query
        seen[:, :self.capacity] &= np.arange(self.capacity)[None, :] < n_past
        if window:
            seen &= query - key < window
        return np.where(seen, 0.0, MASKED).astype(np.float32)[None, None]
