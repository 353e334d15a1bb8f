"""Tiny random-weight GGUF models of today's architectures (qwen3, qwen3moe, gpt-oss) that
llama.cpp loads and runs: the hyper-parameters, tensors and a byte-level BPE vocabulary each
architecture's loader asks for, at a size (tens of MB) where a memory figure means something.

The vocabulary is GPT-2's 256 byte tokens, a few merges and the ChatML markers, so any text
tokenizes. Weights are F16 (F32 for norms and biases): neither is repacked by the CPU backend, so
the estimate's weight term is the file itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_kv: int = 2
    head_dim: int = 64
    n_ff: int = 1024           # a dense model's FFN width
    n_expert: int = 8
    n_used: int = 2
    n_ff_exp: int = 512        # one expert's FFN width
    window: int = 128          # gpt-oss: the sliding window of every other layer


ARCHITECTURES = ("qwen3", "qwen3moe", "gpt-oss")
# About 40 MB each: big enough that the memory estimate's terms show in a process's peak RSS.
SHAPES = {"qwen3": Shape(layers=8, n_ff=3072), "qwen3moe": Shape(layers=6),
          "gpt-oss": Shape(layers=6)}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# gpt-oss's harmony markers, control tokens of its vocabulary as in the published GGUFs.
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
           "<|constrain|>")
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "o n", "Ġ a")


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (its bytes_to_unicode), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    shifted, extra = {}, 0
    for b in range(256):
        if b in printable:
            shifted[b] = chr(b)
        else:
            shifted[b] = chr(256 + extra)
            extra += 1
    return [shifted[b] for b in range(256)]


def vocabulary(arch: str = "qwen3") -> tuple[list[str], list[int]]:
    specials = SPECIALS + (HARMONY if arch == "gpt-oss" else ())
    tokens = byte_tokens() + [m.replace(" ", "") for m in MERGES] + list(specials)
    types = [1] * (len(tokens) - len(specials)) + [3] * len(specials)   # normal, control
    return tokens, types


def write_tiny(path: Path, arch: str, shape: Shape | None = None, *, seed: int = 0) -> Path:
    """A `arch` model with random weights at `path` (of SHAPES[arch] unless `shape`)."""
    if arch not in ARCHITECTURES:
        raise ValueError(arch)
    shape = shape or SHAPES[arch]
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    _hparams(w, arch, shape)
    _tokenizer(w, arch)
    tokens, _ = vocabulary(arch)
    _Tensors(w, rng).model(arch, shape, len(tokens))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hparams(w: GGUFWriter, arch: str, s: Shape) -> None:
    w.add_block_count(s.layers)
    w.add_context_length(4096)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff if arch == "qwen3" else s.n_ff_exp)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch != "qwen3":
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
    if arch == "gpt-oss":
        w.add_sliding_window(s.window)


def _tokenizer(w: GGUFWriter, arch: str) -> None:
    tokens, types = vocabulary(arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    if arch == "gpt-oss":     # harmony: its published template, <|return|> ends the reply
        from chat_templates import GPT_OSS_20B
        w.add_eos_token_id(tokens.index("<|return|>"))
        w.add_chat_template(GPT_OSS_20B)
        return
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                        "<|im_start|>assistant\n{% endif %}")


class _Tensors:
    def __init__(self, w: GGUFWriter, rng: np.random.Generator) -> None:
        self.w, self.rng = w, rng

    def matrix(self, name: str, *shape: int) -> None:
        # numpy's shape is ggml's reversed: (rows, cols) is ne = {cols, rows}.
        values = self.rng.standard_normal(shape) * 0.05
        self.w.add_tensor(name, values.astype(np.float16))

    def vector(self, name: str, *shape: int, around: float = 0.0) -> None:
        values = around + 0.05 * self.rng.standard_normal(shape)
        self.w.add_tensor(name, values.astype(np.float32))

    def model(self, arch: str, s: Shape, n_vocab: int) -> None:
        self.matrix("token_embd.weight", n_vocab, s.n_embd)
        self.vector("output_norm.weight", s.n_embd, around=1.0)
        self.matrix("output.weight", n_vocab, s.n_embd)
        for i in range(s.layers):
            self.attention(f"blk.{i}.", arch, s)
            if arch == "qwen3":
                self.dense_ffn(f"blk.{i}.", s)
            else:
                self.experts(f"blk.{i}.", s, biased=arch == "gpt-oss")

    def attention(self, p: str, arch: str, s: Shape) -> None:
        q, kv = s.n_head * s.head_dim, s.n_kv * s.head_dim
        self.vector(p + "attn_norm.weight", s.n_embd, around=1.0)
        for name, rows, cols in (("attn_q", q, s.n_embd), ("attn_k", kv, s.n_embd),
                                 ("attn_v", kv, s.n_embd), ("attn_output", s.n_embd, q)):
            self.matrix(p + f"{name}.weight", rows, cols)
            if arch == "gpt-oss":
                self.vector(p + f"{name}.bias", rows)
        if arch == "gpt-oss":
            self.vector(p + "attn_sinks.weight", s.n_head)
            self.vector(p + "post_attention_norm.weight", s.n_embd, around=1.0)
        else:
            self.vector(p + "attn_q_norm.weight", s.head_dim, around=1.0)
            self.vector(p + "attn_k_norm.weight", s.head_dim, around=1.0)
            self.vector(p + "ffn_norm.weight", s.n_embd, around=1.0)

    def dense_ffn(self, p: str, s: Shape) -> None:
        self.matrix(p + "ffn_gate.weight", s.n_ff, s.n_embd)
        self.matrix(p + "ffn_up.weight", s.n_ff, s.n_embd)
        self.matrix(p + "ffn_down.weight", s.n_embd, s.n_ff)

    def experts(self, p: str, s: Shape, *, biased: bool) -> None:
        self.vector(p + "ffn_gate_inp.weight", s.n_expert, s.n_embd)
        self.matrix(p + "ffn_gate_exps.weight", s.n_expert, s.n_ff_exp, s.n_embd)
        self.matrix(p + "ffn_up_exps.weight", s.n_expert, s.n_ff_exp, s.n_embd)
        self.matrix(p + "ffn_down_exps.weight", s.n_expert, s.n_embd, s.n_ff_exp)
        if biased:
            self.vector(p + "ffn_gate_inp.bias", s.n_expert)
            self.vector(p + "ffn_gate_exps.bias", s.n_expert, s.n_ff_exp)
            self.vector(p + "ffn_up_exps.bias", s.n_expert, s.n_ff_exp)
            self.vector(p + "ffn_down_exps.bias", s.n_expert, s.n_embd)
