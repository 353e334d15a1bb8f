"""The C++ runtime put in the process's global symbol scope before libllama loads (Linux).

Measured on an H200 machine (2026-12-04, llama.cpp 0.3.36's vendored copy built with
-DGGML_CUDA=on by nvcc 13.0 and g++ 13.3): every `localinfer run` and `bench` crashed with SIGSEGV
while llama.cpp loaded the vocabulary, in std::regex code of libllama that had been bound to a
copy of a libstdc++ symbol inside libggml-cuda.so. A library that ctypes opens resolves its symbols
in the global scope first and only then in its own dependencies, breadth first, where
libggml-cuda comes before libstdc++. With libstdc++ global first (as LD_PRELOAD did in that
measurement, which ran cleanly) every reference binds to the real runtime. On a CPU build it
changes nothing: libstdc++ is the only definition there.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

RUNTIME = "libstdc++.so.6"


@functools.lru_cache(maxsize=1)
def preload() -> bool:
    """Make libstdc++ global (once per process); False where there is none to load."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(RUNTIME, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError:
        return False    # a static or musl build: nothing to put first
    return True
