"""The two graph forms of one exported model, over the same weights.

- dynamic: any number of tokens per call. Attention is ORT's GroupQueryAttention with the rotary
  inside; each layer's KV cache is one preallocated [1, n_kv, capacity, head_dim] buffer bound as
  both past_* input and present_* output, which the op writes in place (no copy per token). The
  rope tables are inputs the host binds once. For the CPU, DirectML and WebGPU providers.
- static: a fixed number of tokens per call (T) and of cache slots (C), plain ONNX ops only, for NPU
  providers that compile fixed shapes and lack the contrib attention op. The host owns the cache:
  each call gets the whole cache, an additive mask and the rope rows of its positions, and returns
  the T new K/V rows. A prefill shape and a decode shape (T=1) share the weights.

Both compute llama.cpp's model (arch.py) in float32; MatMulNBits' accuracy_level picks exact
float arithmetic (0) or int8 activations (4, llama.cpp's own choice on CPU, several times faster).
"""

from __future__ import annotations

import math

import numpy as np

from localinfer.backends.onnx.arch import Spec
from localinfer.backends.onnx.graph import (MAX_INDEX, MS, Graph, add_norm, embed, feed_forward,
                                            head_norm, linear, project, rms_norm)


def dynamic(spec: Spec, weights, accuracy: int, metadata: dict[str, str]):
    """The dynamic-shape graph (GroupQueryAttention, shared KV buffers)."""
    g = Graph(weights)
    g.input("input_ids", "int64", [1, "S"])
    g.input("seqlens_k", "int32", [1])                 # tokens in the cache after this call, - 1
    g.input("total_sequence_length", "int32", [])
    g.input("logits_from", "int64", [1])               # first position whose logits are wanted
    for table in rope_inputs(spec):
        g.input(table, "float32", ["P", spec.head_dim // 2])

    def attention(i: int, q: str, k: str, v: str) -> str:
        past, present = _kv_names(i, "past"), _kv_names(i, "present")
        for name in (*past, *present):
            (g.input if name in past else g.output)(name, "float32",
                                                    [1, spec.n_kv, "C", spec.head_dim])
        cos, sin = _rope_pair(spec, i)
        return g.op("GroupQueryAttention",
                    [q, k, v, *past, "seqlens_k", "total_sequence_length", cos, sin],
                    outputs=[f"attn_{i}", *present], domain=MS, num_heads=spec.n_head,
                    kv_num_heads=spec.n_kv, do_rotary=1, rotary_interleaved=0,
                    scale=spec.attn_scale, local_window_size=_window(spec, i))

    x = _transformer(g, spec, accuracy, attention, fused=True)
    x = g.op("Slice", [x, "logits_from", g.const([MAX_INDEX]), g.const([1])])
    _head(g, spec, x, accuracy, rows="R")
    return g.model("localinfer-dynamic", metadata)


def static(spec: Spec, weights, accuracy: int, tokens: int, slots: int, metadata: dict[str, str]):
    """The static-shape graph: `tokens` per call, `slots` cache rows, plain-op attention."""
    g = Graph(weights)
    g.input("input_ids", "int64", [1, tokens])
    for table in rope_inputs(spec):                    # rows of the call's positions, full width
        g.input(table, "float32", [1, tokens, spec.head_dim])
    for mask in mask_inputs(spec):                     # 0 where a query may look, -1e30 elsewhere
        g.input(mask, "float32", [1, 1, tokens, slots + tokens])
    rep = spec.n_head // spec.n_kv
    masks = {m: g.op("Tile", [m, g.const([1, 1, rep, 1])]) for m in mask_inputs(spec)}

    def attention(i: int, q: str, k: str, v: str) -> str:
        cos, sin = _rope_pair(spec, i)
        cos, sin = (g.op("Unsqueeze", [t, g.const([2])]) for t in (cos, sin))   # [1, T, 1, hd]
        q4 = _rope(g, _heads(g, q, tokens, spec.n_head, spec.head_dim), cos, sin, spec.head_dim)
        k4 = _rope(g, _heads(g, k, tokens, spec.n_kv, spec.head_dim), cos, sin, spec.head_dim)
        v4 = _heads(g, v, tokens, spec.n_kv, spec.head_dim)
        past, new = _kv_names(i, "past"), _kv_names(i, "new")
        for name in past:
            g.input(name, "float32", [1, spec.n_kv, slots, spec.head_dim])
        for name, x4 in zip(new, (k4, v4)):
            g.op("Transpose", [x4], outputs=[name], perm=[0, 2, 1, 3])      # [1, kv, T, hd]
            g.output(name, "float32", [1, spec.n_kv, tokens, spec.head_dim])
        keys, values = (g.op("Concat", [p, n], axis=2) for p, n in zip(past, new))
        # The queries of the heads that share a KV head as one matrix: row = group * T + token.
        qh = g.op("Reshape", [g.op("Transpose", [q4], perm=[0, 2, 1, 3]),
                              g.const([1, spec.n_kv, rep * tokens, spec.head_dim])])
        scores = g.op("MatMul", [qh, g.op("Transpose", [keys], perm=[0, 1, 3, 2])])
        scores = g.op("Mul", [scores, g.const(spec.attn_scale, np.float32)])
        mask = masks["attn_mask_local" if spec.local[i] else "attn_mask"]
        probs = g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1)
        out = g.op("MatMul", [probs, values])                             # [1, kv, rep*T, hd]
        out = g.op("Reshape", [out, g.const([1, spec.n_head, tokens, spec.head_dim])])
        out = g.op("Transpose", [out], perm=[0, 2, 1, 3])
        return g.op("Reshape", [out, g.const([1, tokens, spec.n_head * spec.head_dim])])

    x = _transformer(g, spec, accuracy, attention, fused=False)
    _head(g, spec, x, accuracy, rows=tokens)
    return g.model("localinfer-static", metadata)


# Only the kinds of layer the model has get inputs: OpenVINO misbinds a graph's inputs when one of
# them is read by no node (a model whose every layer slides would leave the global ones unread).
def rope_inputs(spec: Spec) -> tuple[str, ...]:
    return tuple(f"{t}_{kind}" for kind in layer_kinds(spec) for t in ("cos", "sin"))


def mask_inputs(spec: Spec) -> tuple[str, ...]:
    return tuple("attn_mask_local" if kind == "local" else "attn_mask" for kind in layer_kinds(spec))


def layer_kinds(spec: Spec) -> tuple[str, ...]:
    """"global" if any layer attends to the whole context, "local" if any slides."""
    return (*(("global",) if not all(spec.local) else ()), *(("local",) if any(spec.local) else ()))


def kv_outputs(spec: Spec, prefix: str) -> list[str]:
    """Names of every layer's K and V tensors with this prefix (past, present or new)."""
    return [name for i in range(spec.n_layer) for name in _kv_names(i, prefix)]


# -- shared ----------------------------------------------------------------------------------------
def _transformer(g: Graph, spec: Spec, accuracy: int, attention, *, fused: bool) -> str:
    """Embedding and every layer, up to the final norm; returns the hidden states [1, S, n_embd].

    Each residual add is folded into the norm after it (add_norm), so the running sum `x` is
    carried with the branch output `delta` still to be added."""
    x = embed(g, "input_ids", "token_embd.weight")
    if spec.gemma:                       # llama.cpp: inpL * sqrtf(n_embd)
        x = g.op("Mul", [x, g.const(math.sqrt(spec.n_embd), np.float32)])
    delta = None
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        h, x = add_norm(g, x, delta, p + "attn_norm.weight", spec.eps, fused=fused)
        q, k, v = project(g, h, [p + f"attn_{w}.weight" for w in "qkv"], accuracy)
        if spec.gemma:
            q = head_norm(g, q, p + "attn_q_norm.weight", spec.n_head, spec.head_dim, spec.eps,
                          fused=fused)
            k = head_norm(g, k, p + "attn_k_norm.weight", spec.n_kv, spec.head_dim, spec.eps,
                          fused=fused)
        delta = linear(g, attention(i, q, k, v), p + "attn_output.weight", accuracy)
        if spec.gemma:
            delta = rms_norm(g, delta, p + "post_attention_norm.weight", spec.eps, fused=fused)
        h, x = add_norm(g, x, delta, p + "ffn_norm.weight", spec.eps, fused=fused)
        delta = feed_forward(g, h, p, spec.gemma, accuracy)
        if spec.gemma:
            delta = rms_norm(g, delta, p + "post_ffw_norm.weight", spec.eps, fused=fused)
    return add_norm(g, x, delta, "output_norm.weight", spec.eps, fused=fused)[0]


def _head(g: Graph, spec: Spec, x: str, accuracy: int, rows) -> None:
    logits = linear(g, x, "token_embd.weight" if spec.tied else "output.weight", accuracy)
    g.op("Identity", [logits], outputs=["logits"])
    g.output("logits", "float32", [1, rows, spec.n_vocab])


def _kv_names(i: int, prefix: str) -> tuple[str, str]:
    return f"{prefix}_key_{i}", f"{prefix}_value_{i}"


def _rope_pair(spec: Spec, i: int) -> tuple[str, str]:
    return ("cos_local", "sin_local") if spec.local[i] else ("cos_global", "sin_global")


def _window(spec: Spec, i: int) -> int:
    """GroupQueryAttention's local_window_size: the query and window-1 tokens before it, as
    llama.cpp's sliding window (measured against the op); -1 for a global layer."""
    return spec.window if spec.local[i] else -1


def _heads(g: Graph, x: str, tokens: int, n: int, head_dim: int) -> str:
    return g.op("Reshape", [x, g.const([1, tokens, n, head_dim])])


def _rope(g: Graph, x: str, cos: str, sin: str, head_dim: int) -> str:
    """Rotary on half-split pairs (i, i + head_dim/2): x * cos + rotate_half(x) * sin."""
    half = head_dim // 2
    first = g.op("Slice", [x, g.const([0]), g.const([half]), g.const([3])])
    second = g.op("Slice", [x, g.const([half]), g.const([head_dim]), g.const([3])])
    rotated = g.op("Concat", [g.op("Neg", [second]), first], axis=3)
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])])
