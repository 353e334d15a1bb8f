"""Small graphs on ggml's reference CPU kernels: how a 16-bit f16/f16 cache stays exact.

ggml's CPU flash attention has three kernels (ggml-cpu/ops.cpp): a tiled one for 64 query rows or
more, a KV-split one for a single row once 512 cells are in view, and a row-by-row one for the rest;
the first two only when K and V are both f16 (or f32). A decode step past 512 cells therefore adds
its attention in another order than a row of a verification batch, and speculation would change
the output. The CPU backend has a switch that turns the tiled and split kernels (and the tiled
K-quant matrix kernels and op fusion) off: `ggml_backend_cpu_set_use_ref`. Set for every graph of
fewer than 64 rows — decode steps, verification batches, short prefills — and cleared for longer
ones, a prompt prefills on the tiled kernel at llama.cpp's own speed while a step and a
verification row run the same arithmetic at any context length (docs/speculative-decoding.md).

llama.h does not hand out the context's CPU backend, so it is found in the context object: the one
first pointer there whose target starts with a pointer to the CPU backend's GUID. Every candidate is read
through /proc/self/mem, which answers an unmapped address with an error instead of a crash; where
that file is missing (not Linux) or nothing matches, `find` returns None and the caller keeps the
cache that needs no switch (bf16 K, kv.py).
"""

from __future__ import annotations

import ctypes
import functools
import os

TILE_ROWS = 64                  # GGML_FA_TILE_Q: a graph this tall prefills on the tiled kernel
_SCAN_BYTES = 4096              # the context object's leading bytes holding the backend pointer
_CPU_GUID = bytes((0xaa, 0x67, 0xc7, 0x43, 0x96, 0xe6, 0xa3, 0x8a,
                   0xe3, 0xaf, 0xea, 0x92, 0x36, 0xbc, 0xfc, 0x89))   # ggml_backend_cpu_guid()
_USER_SPACE = 1 << 47           # addresses above are not user memory (x86-64, AArch64 4-level)
_DEVICE_TYPE_CPU = 0


@functools.cache
def _setter():
    """ggml_backend_cpu_set_use_ref from the CPU backend libllama uses, or None."""
    from localinfer.backends.llama.engine import engine_ggml
    ggml = engine_ggml()

    def bind(name, restype, *argtypes):
        fn = getattr(ggml, name)
        fn.restype, fn.argtypes = restype, list(argtypes)
        return fn
    try:
        device = bind("ggml_backend_dev_by_type", ctypes.c_void_p, ctypes.c_int)(_DEVICE_TYPE_CPU)
        reg = bind("ggml_backend_dev_backend_reg", ctypes.c_void_p, ctypes.c_void_p)(device)
        address = bind("ggml_backend_reg_get_proc_address", ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_char_p)(reg, b"ggml_backend_cpu_set_use_ref")
    except AttributeError:
        return None
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_bool)(address) if address else None


def available() -> bool:
    """Whether contexts of this process can be steered (checked before one is made)."""
    return (ctypes.sizeof(ctypes.c_void_p) == 8 and os.path.exists("/proc/self/mem")
            and _setter() is not None)


def find(ctx) -> int | None:
    """The address of the llama.cpp context's CPU backend, or None."""
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        base = ctypes.cast(ctx, ctypes.c_void_p).value
        # The first match: the scan may run past the object into a neighbour (a draft's context).
        return next((word for word in _words(_read(fd, base, _SCAN_BYTES))
                     if _read(fd, _pointer(_read(fd, word, 8)), 16) == _CPU_GUID), None)
    finally:
        os.close(fd)


class Steer:
    """Sets the switch before each decode, by the graph's rows; a call only when it changes."""

    def __init__(self, backend: int) -> None:
        self._backend, self._set, self._on = backend, _setter(), None

    def rows(self, n: int) -> None:
        on = n < TILE_ROWS
        if on != self._on:
            self._set(self._backend, on)
            self._on = on


def _read(fd: int, address: int, size: int) -> bytes:
    if not 4096 <= address < _USER_SPACE:
        return b""
    try:
        return os.pread(fd, size, address)
    except OSError:
        return b""


def _pointer(raw: bytes) -> int:
    return int.from_bytes(raw, "little") if len(raw) == 8 else 0


def _words(raw: bytes) -> list[int]:
    return [_pointer(raw[i:i + 8]) for i in range(0, len(raw) - 7, 8)]
