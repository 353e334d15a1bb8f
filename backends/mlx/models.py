"""GGUF architectures onto mlx-lm's model definitions: hyper-parameters, tensor names, and the
few places where GGUF stores a weight differently from the checkpoints mlx-lm was written for.

- llama (SmolLM, Mistral and other llama-architecture GGUFs): the converter permuted the rows of
  Q and K within each head for llama.cpp's interleaved rotary layout; the rows are put back so
  mlx-lm's (half-split) rope applies. Rows of the packed weight, scales and biases move together,
  so this is exact on quantized tensors. A `rope_freqs` tensor (Llama 3 rope scaling) becomes the
  rope's per-dimension frequencies.
- gemma3: the converter stored every RMSNorm weight with Gemma's "+1" already added; mlx-lm adds
  it at run time, so 1 is taken off again. Sliding-window layers use rope base 10,000 and the
  global ones the file's base (and its linear rope scaling), as llama.cpp does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from localinfer.gguf.header import Header

GROUP = 32

_COMMON = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
}
_LLAMA = {**_COMMON, "ffn_norm": "post_attention_layernorm"}
_GEMMA3 = {**_COMMON, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
           "post_attention_norm": "post_attention_layernorm",
           "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class Architecture:
    module: str                                            # mlx_lm.models.<module>
    names: dict[str, str]                                  # GGUF tensor stem -> mlx-lm path
    args: Callable[[Header, Callable], dict]               # (header, key lookup) -> ModelArgs
    fix: Callable[[dict, dict], None]                      # in place, on weights by GGUF name


def supported() -> tuple[str, ...]:
    return tuple(ARCHITECTURES)


def build(header: Header, weights: dict, dtype):
    """The mlx-lm model for this file, its weights loaded (cast to `dtype`), ready to run."""
    import importlib

    import mlx.core as mx
    import mlx.nn as nn

    arch = ARCHITECTURES[str(header.metadata["general.architecture"])]
    key = _lookup(header)
    args_dict = arch.args(header, key)
    arch.fix(weights, args_dict)
    module = importlib.import_module(f"mlx_lm.models.{arch.module}")
    model = module.Model(module.ModelArgs.from_dict(args_dict))
    renamed = {_rename(name, arch.names): _cast(a, dtype) for name, a in weights.items()
               if name != "rope_freqs.weight"}
    if hasattr(model, "sanitize"):
        renamed = model.sanitize(renamed)
    nn.quantize(model, class_predicate=lambda path, _m: _quant_params(renamed, path))
    model.load_weights(list(renamed.items()), strict=True)
    if "rope_freqs.weight" in weights:
        _use_rope_factors(model, weights["rope_freqs.weight"], args_dict)
    mx.eval(model.parameters())
    return model


def _lookup(header: Header) -> Callable:
    prefix = str(header.metadata["general.architecture"])

    def key(name: str, default=None):
        return header.metadata.get(f"{prefix}.{name}", default)
    return key


def _rename(name: str, names: dict[str, str]) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases|bias)", name)
    if m:
        layer, stem, part = m.groups()
        return f"model.layers.{layer}.{names[stem]}.{part}"
    stem, _, part = name.partition(".")
    return f"{names[stem]}.{part}"


def _cast(a, dtype):
    """Float arrays (norms, scales, biases, dense weights) in the compute dtype; codes untouched."""
    import mlx.core as mx
    return a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a


def _quant_params(weights: dict, path: str) -> dict | bool:
    scales = weights.get(f"{path}.scales")
    if scales is None:
        return False
    packed = weights[f"{path}.weight"]
    bits = packed.shape[-1] * 32 // (scales.shape[-1] * GROUP)
    return {"group_size": GROUP, "bits": bits}


# -- llama ------------------------------------------------------------------------------------------
def _llama_args(header: Header, key: Callable) -> dict:
    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise _unsupported(header, "partial rotary embeddings")
    tensors = {t.name for t in header.tensors}
    return {
        "model_type": "llama", "hidden_size": n_embd, "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")), "num_attention_heads": n_head,
        "num_key_value_heads": int(key("attention.head_count_kv", n_head)), "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": _vocab_size(header), "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(header, key),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }


def _llama_fix(weights: dict, args: dict) -> None:
    """Undo the GGUF converter's Q/K row permutation (see the module docstring)."""
    import mlx.core as mx
    head_dim = args["head_dim"]
    for name, weight in list(weights.items()):
        m = re.fullmatch(r"blk\.\d+\.attn_(q|k)\.(weight|scales|biases|bias)", name)
        if m:
            n_head = args["num_attention_heads" if m[1] == "q" else "num_key_value_heads"]
            weights[name] = mx.take(weight, mx.array(_unpermute_rows(n_head, head_dim)), axis=0)


def _unpermute_rows(n_head: int, head_dim: int) -> list[int]:
    """Row order turning llama.cpp's (pair-interleaved) Q/K rows back into the half-split one."""
    import numpy as np
    rows = np.arange(n_head * head_dim).reshape(n_head, head_dim // 2, 2)
    return rows.swapaxes(1, 2).reshape(-1).tolist()


def _use_rope_factors(model, factors, args: dict) -> None:
    """Llama 3 rope scaling as llama.cpp applies it: each dimension's wavelength times its factor."""
    import mlx.core as mx
    import mlx.nn as nn
    dims, base = args["head_dim"], args["rope_theta"]
    freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)

    class FactorRoPE(nn.Module):
        def __call__(self, x, offset: int = 0):
            return mx.fast.rope(x, dims, traditional=False, base=None, scale=1.0, offset=offset,
                                freqs=freqs)

    for layer in model.layers:
        layer.self_attn.rope = FactorRoPE()


# -- gemma3 -----------------------------------------------------------------------------------------
def _gemma3_args(header: Header, key: Callable) -> dict:
    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", 256))
    n_layer = int(key("block_count"))
    # llama.cpp: 1/sqrt(head_dim), except the 27B (62 layers), which scales by n_embd / n_head.
    query_scalar = n_embd // n_head if n_layer == 62 else head_dim
    return {
        "model_type": "gemma3_text", "hidden_size": n_embd, "num_hidden_layers": n_layer,
        "intermediate_size": int(key("feed_forward_length")), "num_attention_heads": n_head,
        "num_key_value_heads": int(key("attention.head_count_kv", n_head)), "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": _vocab_size(header), "rope_theta": float(key("rope.freq_base", 1e6)),
        "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": query_scalar,
        "sliding_window": int(key("attention.sliding_window", 512)),
        "sliding_window_pattern": int(key("attention.sliding_window_pattern", 6) or 6),
        "max_position_embeddings": int(key("context_length", 32768)),
        "rope_scaling": _rope_scaling(header, key),
    }


def _gemma3_fix(weights: dict, _args: dict) -> None:
    """Take off the +1 the GGUF converter added to every Gemma RMSNorm weight."""
    for name in list(weights):
        if name.endswith("norm.weight"):
            weights[name] = weights[name] - 1.0


# -- shared -----------------------------------------------------------------------------------------
def _vocab_size(header: Header) -> int:
    embd = next(t for t in header.tensors if t.name == "token_embd.weight")
    return int(embd.shape[1])


def _rope_scaling(header: Header, key: Callable) -> dict | None:
    kind = key("rope.scaling.type")
    factor = float(key("rope.scaling.factor", 1.0) or 1.0)
    if kind in (None, "none") or factor == 1.0:
        return None
    if kind != "linear":
        raise _unsupported(header, f"'{kind}' rope scaling")
    return {"type": "linear", "factor": factor}


def _unsupported(header: Header, what: str):
    from localinfer.errors import UsageError
    arch = header.metadata.get("general.architecture")
    return UsageError(f"the MLX backend does not support {what} ({arch}); use --backend llama.cpp")


ARCHITECTURES = {
    "llama": Architecture("llama", _LLAMA, _llama_args, _llama_fix),
    "gemma3": Architecture("gemma3_text", _GEMMA3, _gemma3_args, _gemma3_fix),
}
