"""llama.cpp's tensor buffer-type overrides, which llama-cpp-python declares but leaves unbound
(`llama_model_params.tensor_buft_overrides` is a bare pointer): the `--n-cpu-moe` mechanism that
keeps the expert tensors of the first N layers in host memory (fit/moe.py decides N), and the
output layer kept here when other layers sit on RPC workers (`OUTPUT_PATTERN`).

The array is NULL-terminated and read while llama.cpp loads the model; the patterns and the array
live in one object that the session keeps as long as the model.
"""

from __future__ import annotations

import ctypes

from localinfer.backends.llama import devices


def block_pattern(layer: int) -> str:
    """The regular expression llama.cpp searches tensor names with for one layer's experts
    (common/arg.cpp, llm_ffn_exps_block_regex): the weights and their biases (gpt-oss) alike."""
    return rf"blk\.{layer}\.ffn_(up|down|gate)_exps"


# The output projection (or, with tied embeddings, the token embedding's copy that serves as one).
# Overridden to the CPU's buffer type, llama.cpp still picks the CPU's repacked layout where it has
# one (llama_model_loader: "consider the extra buffer types"), so the logits are computed with the
# kernels of a local run, and only a hidden state, not a vocabulary of logits, crosses the network
# per token.
OUTPUT_PATTERN = r"^(output|token_embd)\.(weight|bias)$"


class _Override(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class CpuOverrides:
    """The overrides that put the tensors some patterns match in the CPU's buffer type: layers
    0..n_layers-1's experts, and the output layer with `output`."""

    def __init__(self, n_layers: int, *, output: bool = False) -> None:
        cpu = cpu_buffer_type()
        # Bytes objects, kept here: c_char_p fields point into them, not at copies.
        self.patterns = [block_pattern(i).encode() for i in range(n_layers)]
        if output:
            self.patterns.append(OUTPUT_PATTERN.encode())
        self.array = (_Override * (len(self.patterns) + 1))()    # the last entry stays NULL
        for i, pattern in enumerate(self.patterns):
            self.array[i].pattern = pattern
            self.array[i].buft = cpu
        self.n_layers = n_layers

    @property
    def address(self) -> int:
        """What `llama_model_params.tensor_buft_overrides` takes."""
        return ctypes.addressof(self.array)


def cpu_buffer_type() -> int:
    """The CPU device's buffer type (what common/arg.cpp's --n-cpu-moe uses,
    ggml_backend_cpu_buffer_type), found through the device registry."""
    api = devices._registry()
    cpu = api.by_type(0)                                       # GGML_BACKEND_DEVICE_TYPE_CPU
    buft = api.dev_buffer_type(cpu) if cpu else None
    if not buft:
        raise OSError("this llama.cpp has no CPU buffer type to keep experts in")
    return buft
