"""An independent float64 forward of a GGUF model (llama or gemma3), written from llama.cpp's
definition of each architecture: the reference the ONNX export's exactness is measured against.

It shares no code with the exporter: weights come from gguf's own dequantize, used as stored
(llama's Q/K rows in the GGUF converter's order, with llama.cpp's rotation of adjacent pairs),
and every step is numpy in float64. Tensors are located with the project's header reader (gguf's
GGUFReader takes 10-40 s on these files, building a view of every vocabulary entry).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from localinfer.gguf.header import read_header


class Float64Model:
    def __init__(self, path: Path, *, window: int | None = None) -> None:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        header = read_header(path)
        meta = header.metadata
        self.arch = arch = meta["general.architecture"]
        key = lambda name, default=None: meta.get(f"{arch}.{name}", default)   # noqa: E731
        self.n_layer, self.n_embd = key("block_count"), key("embedding_length")
        self.n_head = key("attention.head_count")
        self.n_kv = key("attention.head_count_kv", self.n_head)
        self.head_dim = key("attention.key_length", self.n_embd // self.n_head)
        self.eps = key("attention.layer_norm_rms_epsilon")
        self.base = key("rope.freq_base", 10000.0)
        self.window = window or key("attention.sliding_window", 0)
        alignment = int(meta.get("general.alignment", 32))
        start = -(-header.header_size // alignment) * alignment
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        self.w = {}
        for t in header.tensors:
            data = raw[start + t.offset:start + t.offset + t.n_bytes]
            values = dequantize(data.reshape(max(1, t.n_elements // t.shape[0]), -1),
                                GGMLQuantizationType[t.type_name])
            self.w[t.name] = values.astype(np.float64).reshape(tuple(reversed(t.shape)))

    def _rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * weight

    def _rope(self, x: np.ndarray, base: float, *, pairs: bool) -> np.ndarray:
        """x [n, heads, head_dim] rotated by position: llama.cpp's mode 0 rotates (2i, 2i+1)
        (llama), NEOX mode rotates (i, i + head_dim/2) (gemma3)."""
        d = self.head_dim
        angle = np.arange(len(x))[:, None, None] * base ** (-np.arange(0, d, 2) / d)
        cos, sin = np.cos(angle), np.sin(angle)
        a, b = (x[..., 0::2], x[..., 1::2]) if pairs else (x[..., :d // 2], x[..., d // 2:])
        out = np.empty_like(x)
        ra, rb = a * cos - b * sin, a * sin + b * cos
        if pairs:
            out[..., 0::2], out[..., 1::2] = ra, rb
        else:
            out[..., :d // 2], out[..., d // 2:] = ra, rb
        return out

    def _attention(self, q, k, v, window: int) -> np.ndarray:
        n, rep = len(q), self.n_head // self.n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        i, j = np.indices((n, n))
        seen = (j <= i) & ((i - j < window) if window else True)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
        scores = np.where(seen, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)

    def logits(self, tokens: list[int]) -> np.ndarray:
        w, n, gemma = self.w, len(tokens), self.arch == "gemma3"
        x = w["token_embd.weight"][tokens]
        if gemma:
            x = x * math.sqrt(self.n_embd)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            local = gemma and i % 6 < 5           # five sliding-window layers to a global one
            base = 10000.0 if local else self.base
            h = self._rms(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).reshape(n, self.n_head, self.head_dim)
            k = (h @ w[p + "attn_k.weight"].T).reshape(n, self.n_kv, self.head_dim)
            v = (h @ w[p + "attn_v.weight"].T).reshape(n, self.n_kv, self.head_dim)
            if gemma:
                q, k = self._rms(q, w[p + "attn_q_norm.weight"]), self._rms(k, w[p + "attn_k_norm.weight"])
            q, k = self._rope(q, base, pairs=not gemma), self._rope(k, base, pairs=not gemma)
            out = self._attention(q, k, v, self.window if local else 0) @ w[p + "attn_output.weight"].T
            if gemma:
                out = self._rms(out, w[p + "post_attention_norm.weight"])
            x = x + out
            h = self._rms(x, w[p + "ffn_norm.weight"])
            gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
            if gemma:       # ggml_gelu: tanh approximation
                act = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
            else:
                act = gate / (1 + np.exp(-gate))
            out = (act * up) @ w[p + "ffn_down.weight"].T
            if gemma:
                out = self._rms(out, w[p + "post_ffw_norm.weight"])
            x = x + out
        head = w.get("output.weight", w["token_embd.weight"])
        return self._rms(x, w["output_norm.weight"]) @ head.T


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl(reference: np.ndarray, model: np.ndarray) -> np.ndarray:
    """KL(reference || model) per position."""
    p, q = log_softmax(reference), log_softmax(model)
    return (np.exp(p) * (p - q)).sum(axis=-1)


# -- an arbiter for engines that round differently ---------------------------------------------------
# Where two engines' greedy sequences part, each ranked its own token a or b first: with Δ the exact
# l_a - l_b and e each engine's error on it, Δ + e_1 >= 0 >= Δ + e_2, so |Δ| <= max(|e_1|, |e_2|).
# On x86-64 llama.cpp rounds every matmul's activations to 8 bits per block (Q8_0 per 32 values,
# Q8_K per 256) on each of its kernel paths: the AVX2/AVX-512 dot products and the repacked 8x8
# kernels an AVX2/AVX-512 CPU without AMX (an AMD EPYC) loads Q4_0/Q4_K/IQ4_NL weights into; the
# ONNX fast mode (MatMulNBits accuracy 4) rounds them to int8 too; MLX (and the float64 forward)
# round nothing. The size of an engine's error is set by that rounding, not by the kernel: against
# this float64 forward over 256 teacher-forced tokens, the error on the difference of the top logit
# and each of the next four reaches 1.09 for llama.cpp at one pair in a thousand (p99.9; the
# same on both kernel paths, Gemma 3; 0.58 on SmolLM2), 0.76-0.83 for ONNX, under 0.05 for MLX.
# The two llama.cpp paths differ from each other by about sqrt(2) times their error: one size,
# independent values, so which prompt parts where changes with the CPU while the bound does not.
PARTING_TOLERANCE = 1.1


def exact_gap(model: Float64Model, tokens: list[int], a: int, b: int) -> float:
    """|l_a - l_b| of the exact model after `tokens`: where two engines took a and b."""
    logits = model.logits(tokens)[-1]
    return abs(float(logits[a] - logits[b]))


def token_nlls(session, tokens: list[int], n_ctx: int, chunks: int, piece: int = 64) -> np.ndarray:
    """Each scored token's negative log-likelihood as `eval` scores it (chunks of n_ctx from a BOS,
    the second half of each scored), in pieces of `piece` rows so a 262k vocabulary stays small."""
    out = []
    for i in range(chunks):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        chunk[0] = session.bos_token
        session.reset()
        for start in range(0, n_ctx, piece):
            logits = session.eval(chunk[start:start + piece], logits="all")
            lo, hi = max(n_ctx // 2, start) - start, min(n_ctx - 1, start + piece) - start
            if lo < hi:
                targets = np.asarray(chunk[start + lo + 1:start + hi + 1])
                log_p = log_softmax(logits[lo:hi])
                out.append(-log_p[np.arange(len(targets)), targets])
    return np.concatenate(out)
