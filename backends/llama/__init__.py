"""The llama.cpp backend (CPU, CUDA, Metal) through llama-cpp-python's low-level C API.

The registry's entry: what it needs is light (the bindings load on first use, the session module
with numpy only when a model loads), so `quantize` and `devices` reach their modules cheaply.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from localinfer.backends import Backend, LoadOptions
from localinfer.backends.llama import cxx_runtime
# The module, not its function: `from localinfer.backends.llama.engine import engine` here would
# make the package's attribute `engine` the function, and `from ...llama import engine` with it.
from localinfer.backends.llama import devices
from localinfer.backends.llama import engine as bindings
from localinfer.machine import is_apple_silicon

if TYPE_CHECKING:
    from localinfer.backends.llama.session import LlamaCppSession

cxx_runtime.preload()    # before any module here opens libllama (see cxx_runtime)


def _is_available() -> bool:
    try:
        bindings.engine()
    except (ImportError, OSError):
        return False
    return True


def _supports_architecture(_architecture: str) -> bool:
    # llama.cpp defines the GGUF architectures; an unknown one fails at load with its own message.
    return True


def _load(path: Path, options: LoadOptions) -> LlamaCppSession:
    from localinfer.backends.llama.session import LlamaCppSession
    return LlamaCppSession(path, options)


def describe() -> dict:
    lib = bindings.engine()
    return {
        "version": bindings.engine_version(),
        # not llama_supports_gpu_offload(): that counts the RPC backend as a GPU
        "gpu_offload": devices.has_local_gpu(),
        "rpc": bool(lib.llama_supports_rpc()),
        "mmap": bool(lib.llama_supports_mmap()),
        "system_info": lib.llama_print_system_info().decode().strip(),
        "metal": is_apple_silicon(),
    }


def _load_batch(path: Path, options: LoadOptions, n_seq: int):
    from localinfer.backends.llama.batched import SequenceBatch
    return SequenceBatch(path, options, n_seq)


def _load_embed(path: Path, options: LoadOptions, n_seq: int):
    from localinfer.backends.llama.embed import LlamaEmbedder
    return LlamaEmbedder(path, options, n_seq)


BACKEND = Backend(
    name="llama.cpp",
    is_available=_is_available,
    supports_architecture=_supports_architecture,
    load=_load,
    describe=describe,
    load_batch=_load_batch,
    load_embed=_load_embed,
)
