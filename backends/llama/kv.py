"""The element types of llama.cpp's KV cache for --kv-type, and why the 16-bit one varies."""

from __future__ import annotations

from localinfer.backends import LoadOptions

# --kv-type -> ggml_type ids of (K, V). The 16-bit cache is llama.cpp's f16/f16 wherever the CPU
# backend can be steered (steer.py): prompts prefill on ggml's tiled attention kernel, and decode
# steps and verification batches, both under 64 rows, run on its reference kernels, so speculation
# and the prompt cache stay exact at any context length. Where it cannot be steered (no
# /proc/self/mem, layers on RPC workers, whose backends are out of reach) K is kept in bf16: a
# K that is neither f16 nor f32 keeps every row off the tiled and KV-split kernels, at the price of
# a slower prefill (0.54x at 512 tokens on SmolLM2), so there a long prompt
# (LoadOptions.long_prompt) gets f16 K and decodes without drafts past 256 cells: the exactness
# probe, keyed by kv_label, finds its batches inexact (docs/speculative-decoding.md).
# GPU builds keep f16 K: their attention kernels are instantiated for like K and V types, and the
# exactness probe measures what their batches do.
_GGML_KV_TYPES = {"f16": (30, 1), "q8_0": (8, 8), "q4_0": (2, 2)}
_GGML_F16 = 1


def _gpu_build() -> bool:
    """A build with a GPU backend that sees a GPU. Not llama_supports_gpu_offload(): that is true
    of any build with the RPC backend, whose workers compute with the CPU's kernels."""
    from localinfer.backends.llama.devices import has_local_gpu
    return has_local_gpu()


def steers(options: LoadOptions) -> bool:
    """Whether a context for these options gets an f16/f16 cache and the steered CPU backend."""
    from localinfer.backends.llama import rpc, steer
    remote = rpc.in_use() and options.gpu_layers != 0
    return (options.kv_type == "f16" and not remote and not _gpu_build()
            and steer.available())


def kv_cache_types(options: LoadOptions, steered: bool) -> tuple[int, int]:
    """ggml_type ids of the K and V cache for --kv-type on this build (see _GGML_KV_TYPES)."""
    k, v = _GGML_KV_TYPES[options.kv_type]
    if options.kv_type == "f16" and (steered or options.long_prompt or _gpu_build()):
        k = _GGML_F16
    return k, v


def kv_label(options: LoadOptions, steered: bool) -> str:
    """--kv-type, marked where the 16-bit cache of a CPU build is f16/f16 (steered or not)."""
    if steered:
        return "f16/f16+ref"
    if options.kv_type == "f16" and options.long_prompt and not _gpu_build():
        return "f16/f16"
    return options.kv_type


_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 8: "q8_0", 30: "bf16"}


def kv_path(types: tuple[int, int], steered: bool) -> str:
    """In words, the cache and the attention kernels a context of these types runs on."""
    k, v = (_NAMES.get(t, str(t)) for t in types)
    cache = f"{k}/{v} KV cache"
    if steered:
        return f"{cache}: prefill on the tiled kernel, steps and drafts on the reference kernels"
    if _gpu_build():
        return cache
    if types == (_GGML_F16, _GGML_F16):
        return f"{cache}: prefill on the tiled kernel, no drafts past 256 cells"
    return f"{cache}: every row on the row-by-row kernel"
