"""Building blocks of the exported graphs: a small node builder and the layers both forms share.

Weights are never inside a graph file: every graph of a model refers by offset to the one weights
file the export wrote (store.py), so the dynamic graph and the static prefill and decode graphs
share them, and a new graph form costs a few kilobytes, not another copy of the model.
"""

from __future__ import annotations

import numpy as np

MS = "com.microsoft"           # the domain of ORT's contrib ops (MatMulNBits, GroupQueryAttention)
OPSET = 21
MAX_INDEX = np.iinfo(np.int64).max


class Graph:
    """Nodes, graph inputs and outputs, and the initializers they use (weights by reference)."""

    def __init__(self, weights) -> None:
        from onnx import TensorProto, helper
        self._helper, self._types = helper, TensorProto
        self.weights = weights          # an onnx_store.WeightIndex
        self.nodes: list = []
        self.inputs: list = []
        self.outputs: list = []
        self.initializers: dict[str, object] = {}
        self._n = 0

    def _name(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def op(self, op_type: str, inputs: list[str], *, outputs: list[str] | None = None,
           domain: str | None = None, **attrs) -> str:
        """Add a node; returns its (first) output's name."""
        return self.ops(op_type, inputs, outputs=outputs, domain=domain, **attrs)[0]

    def ops(self, op_type: str, inputs: list[str], *, outputs: list[str] | None = None,
            n_out: int = 1, domain: str | None = None, **attrs) -> list[str]:
        """Add a node; returns the names of its outputs."""
        outs = outputs or [self._name(op_type) for _ in range(n_out)]
        self.nodes.append(self._helper.make_node(op_type, inputs, outs, name=self._name("n"),
                                                 domain=domain, **attrs))
        return outs

    def const(self, values, dtype=np.int64) -> str:
        """A small constant held inside the graph (shapes, axes, scalars)."""
        from onnx import numpy_helper
        name = self._name("c")
        self.initializers[name] = numpy_helper.from_array(np.asarray(values, dtype=dtype), name)
        return name

    def shared(self, name: str, values: np.ndarray) -> str:
        """A constant held inside the graph once, however many nodes use it."""
        from onnx import numpy_helper
        if name not in self.initializers:
            self.initializers[name] = numpy_helper.from_array(values, name)
        return name

    def weight(self, name: str) -> str:
        """An initializer stored in the weights file."""
        if name not in self.initializers:
            self.initializers[name] = self.weights.tensor_proto(name)
        return name

    def input(self, name: str, dtype: str, shape: list) -> str:
        self.inputs.append(self._helper.make_tensor_value_info(name, self._dtype(dtype), shape))
        return name

    def output(self, name: str, dtype: str, shape: list) -> None:
        self.outputs.append(self._helper.make_tensor_value_info(name, self._dtype(dtype), shape))

    def _dtype(self, dtype: str) -> int:
        return {"float32": self._types.FLOAT, "int64": self._types.INT64,
                "int32": self._types.INT32}[dtype]

    def model(self, name: str, metadata: dict[str, str]):
        import onnx
        h = self._helper
        graph = h.make_graph(self.nodes, name, self.inputs, self.outputs,
                             list(self.initializers.values()))
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET), h.make_opsetid(MS, 1)],
                             ir_version=10, producer_name="localinfer")
        model.metadata_props.extend(onnx.StringStringEntryProto(key=k, value=str(v))
                                    for k, v in metadata.items())
        return model


# -- layers ----------------------------------------------------------------------------------------
def linear(g: Graph, x: str, name: str, accuracy: int) -> str:
    """x @ W^T for the GGUF matrix `name` (x is [1, S, cols])."""
    m = g.weights.matrix(name)
    if m.bits == 0:
        return g.op("MatMul", [x, g.weight(name + ".t")])
    y = g.op("MatMulNBits", [x, g.weight(name + ".codes"), g.weight(name + ".scales")], domain=MS,
             K=m.cols, N=m.rows, bits=m.bits, block_size=m.block, accuracy_level=accuracy)
    if m.offsets:
        # w = scale * (code - zero) + offset per block: the offsets' share of x @ W^T is each
        # block's sum of x times its offset, a MatMul 1/block the size of the dense one. The sums
        # are one MatMul with a 0/1 matrix (one kernel, where Reshape + ReduceSum were two: half
        # the nodes of a decode step are offset terms on Q4_1 models, and each costs ~10 us).
        sums = g.op("MatMul", [x, _block_ones(g, m.cols, m.block)])
        y = g.op("Add", [y, g.op("MatMul", [sums, g.weight(name + ".offsets")])])
    return y


def _block_ones(g: Graph, cols: int, block: int) -> str:
    """[cols, cols / block]: column b is 1 on the rows of block b."""
    ones = np.kron(np.eye(cols // block, dtype=np.float32), np.ones((block, 1), np.float32))
    return g.shared(f"block_ones_{cols}_{block}", ones)


def project(g: Graph, x: str, names: list[str], accuracy: int) -> list[str]:
    """x @ W^T for several GGUF matrices that read x: one stacked MatMulNBits and a Split where
    the export stacked them (onnx_export.stacks), one each otherwise."""
    stack = g.weights.stacked(names)
    if stack is None:
        return [linear(g, x, name, accuracy) for name in names]
    sizes = [rows for _, rows in g.weights.matrix(stack).parts]
    return g.ops("Split", [linear(g, x, stack, accuracy), g.const(sizes)], n_out=len(names),
                 axis=-1)


def embed(g: Graph, ids: str, name: str) -> str:
    """Rows `ids` ([1, S]) of the GGUF matrix `name`, dequantized in the graph with plain ops (so
    every provider runs it): the same blocks the head's MatMulNBits reads, no float table."""
    m = g.weights.matrix(name)
    if m.bits == 0:                 # dense tables are stored transposed, [cols, rows]
        cols = g.op("Gather", [g.weight(name + ".t"), ids], axis=1)
        return g.op("Transpose", [cols], perm=[1, 2, 0])
    codes = g.op("Gather", [g.weight(name + ".codes"), ids])           # [1, S, blocks, bytes]
    if m.bits == 4:
        # low = codes - 16 * high, not (codes << 4) >> 4: OpenVINO's left shift of a uint8
        # saturates (0xA5 << 4 gives 255, not 0x50).
        high = g.op("BitShift", [codes, g.const(4, np.uint8)], direction="RIGHT")
        low = g.op("Sub", [codes, g.op("Mul", [high, g.const(16, np.uint8)])])
        pairs = g.op("Concat", [g.op("Unsqueeze", [low, g.const([-1])]),
                                g.op("Unsqueeze", [high, g.const([-1])])], axis=-1)
        codes = g.op("Reshape", [pairs, g.const([0, 0, 0, m.block])])
    centred = g.op("Sub", [g.op("Cast", [codes], to=1), g.const(1 << (m.bits - 1), np.float32)])
    scales = g.op("Gather", [g.weight(name + ".scales"), ids])          # [1, S, blocks]
    rows = g.op("Mul", [centred, g.op("Unsqueeze", [scales, g.const([-1])])])
    if m.offsets:
        offsets = g.op("Gather", [g.weight(name + ".offsets"), ids], axis=1)   # [blocks, 1, S]
        offsets = g.op("Transpose", [offsets], perm=[1, 2, 0])
        rows = g.op("Add", [rows, g.op("Unsqueeze", [offsets, g.const([-1])])])
    return g.op("Reshape", [rows, g.const([0, 0, m.cols])])


def rms_norm(g: Graph, x: str, weight: str, eps: float, *, fused: bool) -> str:
    """x / sqrt(mean(x^2) + eps) * w over the last axis: ORT's fused op, or plain ops."""
    w = g.weight(weight)
    if fused:
        return g.op("SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=eps)
    mean = g.op("ReduceMean", [g.op("Mul", [x, x]), g.const([-1])], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean, g.const(eps, np.float32)])])])
    return g.op("Mul", [g.op("Mul", [x, inv]), w])


def add_norm(g: Graph, x: str, delta: str | None, weight: str, eps: float, *,
             fused: bool) -> tuple[str, str]:
    """(rms_norm(x + delta), x + delta): the residual add and the next norm, one kernel where the
    provider has ORT's fused op. delta None: no residual to add (the first layer)."""
    if delta is None:
        return rms_norm(g, x, weight, eps, fused=fused), x
    if fused:
        outs = [g._name("norm"), "", "", g._name("residual")]
        g.ops("SkipSimplifiedLayerNormalization", [x, delta, g.weight(weight)], outputs=outs,
              domain=MS, epsilon=eps)
        return outs[0], outs[3]
    x = g.op("Add", [x, delta])
    return rms_norm(g, x, weight, eps, fused=False), x


def head_norm(g: Graph, x: str, weight: str, n_heads: int, head_dim: int, eps: float, *,
              fused: bool) -> str:
    """Gemma 3's RMSNorm of each head of Q or K ([1, S, heads * head_dim])."""
    heads = g.op("Reshape", [x, g.const([0, 0, n_heads, head_dim])])
    normed = rms_norm(g, heads, weight, eps, fused=fused)
    return g.op("Reshape", [normed, g.const([0, 0, n_heads * head_dim])])


def feed_forward(g: Graph, x: str, prefix: str, gelu: bool, accuracy: int) -> str:
    gate, up = project(g, x, [prefix + "ffn_gate.weight", prefix + "ffn_up.weight"], accuracy)
    if gelu:                       # ggml_gelu: the tanh approximation
        act = g.op("Gelu", [gate], approximate="tanh")
    else:                          # SiLU
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
    return linear(g, g.op("Mul", [act, up]), prefix + "ffn_down.weight", accuracy)
