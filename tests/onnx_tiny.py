"""Tiny llama and gemma3 GGUF files with random weights in chosen block formats: every format the
exporter reads, in every place of the graph (embedding gather, tied head, attention, FFN), at a
size where export and a float64 reference take milliseconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from test_onnx_weights import random_tensor

N_EMBD, N_HEAD, N_KV, HEAD_DIM, N_FF, N_VOCAB = 256, 4, 2, 64, 512, 512
# Block scales that keep random weights near 0.05 (K-quant sub-block scales multiply d by up to 63,
# Q6_K's by up to 127), so activations stay in a range real models have.
_SCALE = {"Q4_K": 0.0006, "Q5_K": 0.0003, "Q6_K": 0.00015, "Q2_K": 0.002, "Q3_K": 0.0006,
          "Q5_0": 0.005, "Q5_1": 0.003, "Q8_0": 0.0006}


def write_tiny(path: Path, arch: str, types: dict[str, str], *, layers: int = 2,
               window: int = 8, seed: int = 0) -> Path:
    """A model whose matrices use types[role] (roles: embd, q, k, v, o, gate, up, down; F32 when
    not named); the norm weights are random around 1, gemma3's stored with their +1."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        w.add_sliding_window(window)

    def matrix(name: str, role: str, rows: int, cols: int) -> None:
        type_name = types.get(role, "F32")
        if type_name in ("F32", "F16"):
            values = rng.standard_normal((rows, cols)) * 0.05
            w.add_tensor(name, values.astype(np.float32 if type_name == "F32" else np.float16))
        else:
            raw = random_tensor(type_name, rows, cols, seed=int(rng.integers(1 << 30)),
                                scale=_SCALE.get(type_name, 0.01))
            w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[type_name])

    def norm(name: str, size: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    q, kv = N_HEAD * HEAD_DIM, N_KV * HEAD_DIM
    matrix("token_embd.weight", "embd", N_VOCAB, N_EMBD)
    norm("output_norm.weight", N_EMBD)
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", N_EMBD)
        norm(p + "ffn_norm.weight", N_EMBD)
        for name, role, rows, cols in (
                ("attn_q", "q", q, N_EMBD), ("attn_k", "k", kv, N_EMBD), ("attn_v", "v", kv, N_EMBD),
                ("attn_output", "o", N_EMBD, q), ("ffn_gate", "gate", N_FF, N_EMBD),
                ("ffn_up", "up", N_FF, N_EMBD), ("ffn_down", "down", N_EMBD, N_FF)):
            matrix(p + f"{name}.weight", role, rows, cols)
        if arch == "gemma3":
            for name, size in (("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM),
                               ("post_attention_norm", N_EMBD), ("post_ffw_norm", N_EMBD)):
                norm(p + f"{name}.weight", size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
