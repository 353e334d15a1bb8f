"""Does the loaded llama.cpp library lay out its parameter structs as the bindings do?

llama-cpp-python's bindings describe one llama.cpp's structs field by field. A library built from
another commit (LLAMA_CPP_LIB_PATH, a rebuilt wheel) may add a field: a newer llama.cpp inserted
`moe_cache_size` into llama_context_params, moving every later field by 8 bytes, and the old
bindings would then write our KV types and batch sizes into the wrong fields, and its
default-params function would write past the buffer ctypes gave it. So before any model loads, the
library's own default-params functions fill a buffer larger than the bindings' struct, and

- the bytes past the struct must stay untouched (the library's struct is not larger), and
- the fields we set must hold the defaults this llama.cpp writes (a shifted layout moves them).

The buffer is handed over as the hidden first argument a struct-returning function takes on
x86-64 (System V and Windows alike); elsewhere (AArch64 passes it in another register) only the
defaults are compared, through the bindings' own declaration.
"""

from __future__ import annotations

import ctypes
import functools
import platform

from localinfer.errors import LocalinferError

GUARD = 256                # bytes past the struct that must stay as written
CANARY = 0xA5
# The defaults of the fields localinfer sets, as llama.cpp's default-params functions write them
# (src/llama-context.cpp, src/llama-model.cpp of the vendored copy): stable across many releases.
CONTEXT_DEFAULTS = {"n_ctx": 512, "n_batch": 2048, "n_ubatch": 512, "n_seq_max": 1,
                    "type_k": 1, "type_v": 1, "offload_kqv": True, "swa_full": True,
                    "kv_unified": False, "ctx_other": None}
MODEL_DEFAULTS = {"devices": None, "tensor_buft_overrides": None, "n_gpu_layers": -1,
                  "vocab_only": False, "use_extra_bufts": True}


class EngineMismatch(LocalinferError):
    """The loaded library's structs are not the ones the installed bindings describe."""


def check(lib: ctypes.CDLL, bindings) -> None:
    """Raise EngineMismatch naming the first struct the library lays out otherwise."""
    for function, struct, defaults in (
            ("llama_context_default_params", bindings.llama_context_params, CONTEXT_DEFAULTS),
            ("llama_model_default_params", bindings.llama_model_params, MODEL_DEFAULTS)):
        problem = struct_problem(lib, function, struct, defaults)
        if problem:
            raise EngineMismatch(
                f"the llama.cpp library loaded ({getattr(lib, '_name', '?')}) does not match "
                f"the bindings of llama-cpp-python {_bindings_version()}: {problem}; use the "
                "llama.cpp these bindings vendor (docs/engine.md), or unset LLAMA_CPP_LIB_PATH")


def struct_problem(lib: ctypes.CDLL, function: str, struct: type[ctypes.Structure],
                   defaults: dict[str, object]) -> str | None:
    """What is wrong with `struct` as `function` fills it, or None."""
    size = ctypes.sizeof(struct)
    image = _filled(lib, function, struct)
    if image[size:] and any(byte != CANARY for byte in image[size:]):
        return (f"{struct.__name__} is larger than the {size} bytes the bindings describe "
                f"({function} wrote past them)")
    params = struct.from_buffer_copy(image[:size])
    for name, expected in defaults.items():
        found = getattr(params, name)
        if _plain(found) != expected:
            return (f"{struct.__name__}.{name} holds {_plain(found)!r} where this llama.cpp "
                    f"writes {expected!r} (its fields lie elsewhere)")
    return None


def _filled(lib: ctypes.CDLL, function: str, struct: type[ctypes.Structure]) -> bytes:
    size = ctypes.sizeof(struct)
    if platform.machine().lower() in ("x86_64", "amd64"):
        buffer = (ctypes.c_uint8 * (size + GUARD))(*([CANARY] * (size + GUARD)))
        ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)((function, lib))(
            ctypes.addressof(buffer))
        return bytes(buffer)
    return bytes(ctypes.CFUNCTYPE(struct)((function, lib))())


def _plain(value: object) -> object:
    """A field's value as the defaults table writes it: NULL pointers as None."""
    if isinstance(value, (ctypes._Pointer, ctypes.c_void_p)):
        return ctypes.cast(value, ctypes.c_void_p).value
    return value


@functools.cache
def _bindings_version() -> str:
    from importlib.metadata import version
    return version("llama-cpp-python")
