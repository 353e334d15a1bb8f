"""The element types of llama.cpp's KV cache for --kv-type, and why the 16-bit one varies."""

from __future__ import annotations

from localinfer.backends import LoadOptions

# --kv-type -> ggml_type ids of (K, V). The 16-bit cache keeps K in bf16, not f16: ggml's CPU
# flash attention gives one query row a KV-split kernel once 512 or more cells are in view, and a
# 64-row batch a tiled one, but only when K is f16 (or f32) and V the same type. Otherwise every
# row takes the row-by-row kernel, so a single decode step and a row of a verification batch
# compute the same bits at any context length: what exact speculation and the prompt cache rest
# on. Same size and quality, but a prompt's prefill loses the tiled kernel: 0.54x at 512 tokens,
# 0.19x at 4,096 on SmolLM2 here. So a long prompt (LoadOptions.long_prompt) gets f16 K, and the
# exactness probe, keyed by the cache's types, finds that its verification batches past 256 cells
# are not single steps: such a run decodes without drafts (docs/speculative-decoding.md).
# GPU builds keep f16 K: their attention kernels are instantiated for like K and V types, and the
# exactness probe measures what their batches do.
_GGML_KV_TYPES = {"f16": (30, 1), "q8_0": (8, 8), "q4_0": (2, 2)}
_GGML_F16 = 1


def _gpu_build() -> bool:
    """A build with a GPU backend that sees a GPU. Not llama_supports_gpu_offload(): that is true
    of any build with the RPC backend, whose workers compute with the CPU's kernels."""
    from localinfer.backends.llama.devices import has_local_gpu
    return has_local_gpu()


def kv_cache_types(options: LoadOptions) -> tuple[int, int]:
    """ggml_type ids of the K and V cache for --kv-type on this build (see _GGML_KV_TYPES)."""
    k, v = _GGML_KV_TYPES[options.kv_type]
    if options.kv_type == "f16" and (options.long_prompt or _gpu_build()):
        k = _GGML_F16
    return k, v


def kv_label(options: LoadOptions) -> str:
    """--kv-type, marked where a long prompt's 16-bit cache keeps K in f16 on a CPU build."""
    if options.kv_type == "f16" and options.long_prompt and not _gpu_build():
        return "f16/f16"
    return options.kv_type
