"""What the ONNX export needs to know about a GGUF model, read from its header and checked.

The two families the exporter builds, as llama.cpp defines them (src/llama-model.cpp):
- llama: RMSNorm, rotary on pairs of adjacent Q/K rows (the GGUF converter permuted HF's rows for
  that; the export puts them back so GroupQueryAttention's half-split rotary applies), SiLU-gated
  FFN, optional Llama 3 rope factors (`rope_freqs.weight`) and linear rope scaling.
- gemma3: embeddings times sqrt(n_embd), RMSNorm on Q and K per head, norms after attention and
  FFN, tanh-GELU-gated FFN, and five sliding-window layers (rope base 10,000) to each global one
  (the file's rope base and scaling). Its norm weights are stored with Gemma's "+1" already added.

Every number from the file is checked before it sizes anything: a damaged or hostile header ends in
one ModelLoadError line, an architecture or feature the exporter lacks in one UsageError line. The
real-valued hyper-parameters (norm epsilon, rope base and scaling) are checked where every backend
checks them, gguf_checks.check_hparams; the counts here only against what the exporter can build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from localinfer.errors import ModelLoadError, UsageError
from localinfer.gguf.checks import check_hparams, refusal
from localinfer.gguf.header import ArrayInfo, CorruptFile, Header

ARCHITECTURES = ("llama", "gemma3")
_LIMITS = {"n_embd": 1 << 16, "n_head": 1024, "head_dim": 1024, "n_ff": 1 << 20,
           "n_vocab": 1 << 22}
GEMMA3_SWA_PATTERN = 6          # llama.cpp: hparams.set_swa_pattern(6) for gemma3
GEMMA3_LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Spec:
    """The hyper-parameters of one model, as the graph builder uses them."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    eps: float
    rope_base: float
    rope_scale: float                   # positions are multiplied by this (1 / linear factor)
    attn_scale: float
    n_ctx_train: int
    window: int = 0                     # sliding-window length of local layers; 0: none
    local: tuple[bool, ...] = ()        # per layer: a sliding-window layer
    local_rope_base: float = 0.0
    rope_factors: bool = False          # a rope_freqs.weight tensor divides the frequencies
    tied: bool = True                   # the output head is the embedding table

    @property
    def gemma(self) -> bool:
        return self.arch == "gemma3"

    def layer_tensors(self, i: int) -> dict[str, tuple[int, ...]]:
        """GGUF name -> shape (ggml order: row length first) of every tensor of layer i."""
        p, d, q, kv = f"blk.{i}.", self.n_embd, self.n_head * self.head_dim, self.n_kv * self.head_dim
        shapes = {p + "attn_norm.weight": (d,), p + "attn_q.weight": (d, q),
                  p + "attn_k.weight": (d, kv), p + "attn_v.weight": (d, kv),
                  p + "attn_output.weight": (q, d), p + "ffn_norm.weight": (d,),
                  p + "ffn_gate.weight": (d, self.n_ff), p + "ffn_up.weight": (d, self.n_ff),
                  p + "ffn_down.weight": (self.n_ff, d)}
        if self.gemma:
            shapes.update({p + "attn_q_norm.weight": (self.head_dim,),
                           p + "attn_k_norm.weight": (self.head_dim,),
                           p + "post_attention_norm.weight": (d,), p + "post_ffw_norm.weight": (d,)})
        return shapes

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the export reads, with its shape."""
        shapes = {"token_embd.weight": (self.n_embd, self.n_vocab),
                  "output_norm.weight": (self.n_embd,)}
        if not self.tied:
            shapes["output.weight"] = (self.n_embd, self.n_vocab)
        if self.rope_factors:
            shapes["rope_freqs.weight"] = (self.head_dim // 2,)
        for i in range(self.n_layer):
            shapes.update(self.layer_tensors(i))
        return shapes


def read_spec(path: Path, header: Header) -> Spec:
    """The checked Spec of a GGUF file; UsageError or ModelLoadError (one line) otherwise."""
    arch = str(header.metadata.get("general.architecture", "unknown"))
    if arch not in ARCHITECTURES:
        raise UsageError(unsupported_message(arch))
    try:
        check_hparams(header.metadata)     # a no-op after checked_header, the loaders' first step
    except CorruptFile as e:
        raise refusal(path, str(e)) from None
    try:
        spec = _spec(arch, header)
        _check_tensors(spec, header)
    except _Refused as e:
        raise ModelLoadError(f"cannot export {path.name} to ONNX: {e}; use --backend llama.cpp") from None
    except _Unsupported as e:
        raise UsageError(f"the ONNX backend does not support {e} ({arch}); "
                         "use --backend llama.cpp") from None
    return spec


def unsupported_message(arch: str) -> str:
    return (f"the ONNX backend cannot run the '{arch}' architecture (it runs "
            f"{', '.join(sorted(ARCHITECTURES))}); use --backend llama.cpp or --backend auto")


class _Refused(Exception):
    """A value no real model has: a damaged or hostile file."""


class _Unsupported(Exception):
    """A real feature the exporter does not build."""


def _spec(arch: str, header: Header) -> Spec:
    meta = header.metadata

    def num(key: str, default=None, *, limit: int | None = None) -> int:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, (list, ArrayInfo)):
            raise _Unsupported(f"per-layer values of {key}")
        if type(value) is not int or value < 1 or (limit and value > limit):
            raise _Refused(f"{arch}.{key} is {value!r}, not a count from 1 to {limit or 'any'}")
        return value

    def real(key: str, default: float) -> float:       # its range checked by check_hparams
        return float(meta.get(f"{arch}.{key}", default))

    if meta.get(f"{arch}.expert_count"):
        raise _Unsupported("mixture-of-experts layers")
    n_layer = num("block_count", limit=512)
    n_embd = num("embedding_length", limit=_LIMITS["n_embd"])
    n_head = num("attention.head_count", limit=_LIMITS["n_head"])
    n_kv = num("attention.head_count_kv", n_head, limit=n_head)
    if n_head % n_kv:
        raise _Refused(f"{n_head} attention heads cannot share {n_kv} KV heads")
    if n_embd % n_head and f"{arch}.attention.key_length" not in meta:
        raise _Refused(f"{arch}.embedding_length {n_embd} does not divide into {n_head} heads")
    head_dim = num("attention.key_length", n_embd // n_head, limit=_LIMITS["head_dim"])
    if num("attention.value_length", head_dim, limit=_LIMITS["head_dim"]) != head_dim:
        raise _Unsupported("value heads of another size than key heads")
    if head_dim % 2 or num("rope.dimension_count", head_dim, limit=_LIMITS["head_dim"]) != head_dim:
        raise _Unsupported("partial rotary embeddings")
    n_vocab = _vocab_rows(header, n_embd)
    common = dict(arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv=n_kv,
                  head_dim=head_dim, n_ff=num("feed_forward_length", limit=_LIMITS["n_ff"]),
                  n_vocab=n_vocab, eps=real("attention.layer_norm_rms_epsilon", 1e-5),
                  rope_scale=1.0 / _linear_factor(arch, meta),
                  n_ctx_train=num("context_length", 4096, limit=1 << 24),
                  tied="output.weight" not in {t.name for t in header.tensors})
    if arch == "gemma3":
        window = num("attention.sliding_window", 512, limit=1 << 24)
        # llama.cpp: 1/sqrt(head_dim), except the 27B (62 layers): 1/sqrt(n_embd / n_head).
        scale = 1.0 / math.sqrt(n_embd / n_head if n_layer == 62 else head_dim)
        local = tuple(i % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1 for i in range(n_layer))
        return Spec(**common, rope_base=real("rope.freq_base", 1e6), attn_scale=scale,
                    window=window, local=local, local_rope_base=GEMMA3_LOCAL_ROPE_BASE)
    if meta.get(f"{arch}.attention.scale") is not None:
        raise _Unsupported("a custom attention scale")
    return Spec(**common, rope_base=real("rope.freq_base", 10000.0),
                attn_scale=1.0 / math.sqrt(head_dim), local=(False,) * n_layer,
                rope_factors="rope_freqs.weight" in {t.name for t in header.tensors})


def _linear_factor(arch: str, meta) -> float:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", 1.0)    # finite, 0 or more: check_hparams
    if kind == "none" or factor in (0, 1):
        return 1.0
    if kind != "linear":
        raise _Unsupported(f"{kind!r} rope scaling")
    return float(factor)


def _vocab_rows(header: Header, n_embd: int) -> int:
    embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2 or embd.shape[0] != n_embd:
        raise _Refused("token_embd.weight is missing or not n_embd wide")
    if not 0 < embd.shape[1] <= _LIMITS["n_vocab"]:
        raise _Refused(f"token_embd.weight has {embd.shape[1]} rows")
    return int(embd.shape[1])


def _check_tensors(spec: Spec, header: Header) -> None:
    """Every tensor the graph reads exists with exactly the shape the hyper-parameters give it."""
    found = {t.name: t.shape for t in header.tensors}
    for name, shape in spec.tensors().items():
        if name not in found:
            raise _Refused(f"tensor {name} is missing")
        if tuple(found[name]) != shape:
            raise _Refused(f"tensor {name} has shape {tuple(found[name])}, expected {shape}")
    extra = sorted(n for n in found if n.startswith("blk.0.") and n not in spec.layer_tensors(0))
    if extra:     # e.g. attention biases: weights the graph would silently leave out
        raise _Unsupported(f"the tensor {extra[0]}")
