"""The llama_cpp bindings, loaded on first use, and the router of llama.cpp's log lines.

Every module of this backend reaches the engine through here, so none of them needs the session
module (and the session, the grammar and the KV-cache code do not import one another in a ring).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections import deque
from pathlib import Path
from typing import Callable


# The libraries of a llama.cpp build (libllama, libggml-base, -cpu, -cuda, ...; llama.dll, ...).
_ENGINE_LIBRARIES = ("libllama", "libggml", "llama", "ggml")


def engine():
    """The llama_cpp bindings (their shared library loads on first use)."""
    import llama_cpp  # lazy: importing loads the shared library
    return llama_cpp


class _Log:
    """Routes llama.cpp's log lines: to stderr when verbose, otherwise kept for error messages."""

    _DEBUG, _CONT = 1, 5   # ggml_log_level: DEBUG lines are dropped even when verbose

    def __init__(self) -> None:
        self.verbose = False
        self.recent: deque[str] = deque(maxlen=20)
        # Observes every fragment (level, text) as it arrives, e.g. the quantizer's per-tensor lines.
        self.listener: Callable[[int, str], None] | None = None
        self._level = 0
        lib = engine()
        # Keep a reference: llama.cpp calls through this pointer for the life of the process.
        self._callback = lib.llama_log_callback(self._on_line)
        lib.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _on_line(self, level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level != self._CONT:
            self._level = level
        line = text.decode("utf-8", "replace")
        if self.listener is not None:
            self.listener(self._level, line)
        if self.verbose and self._level != self._DEBUG:
            sys.stderr.write(line)
        elif line.strip():
            self.recent.append(line.strip())

    def last_error(self) -> str | None:
        # "error loading model: <reason>" comes before a generic "failed to load model": prefer it.
        for words in (("error",), ("failed", "unknown")):
            for line in reversed(self.recent):
                if any(word in line.lower() for word in words):
                    return line
        return self.recent[-1] if self.recent else None


_log: _Log | None = None


def init_engine(verbose: bool) -> _Log:
    """Start llama.cpp once per process and route its log; returns the log router."""
    global _log
    if _log is None:
        from localinfer.backends.llama import abi
        from llama_cpp import llama_cpp as bindings
        # Before the first params struct is filled: a library of another layout refuses here.
        abi.check(bindings._lib, bindings)
        _log = _Log()
        engine().llama_backend_init()
    _log.verbose = verbose
    _log.recent.clear()
    return _log


def engine_version() -> str:
    """llama-cpp-python's version (the bindings')."""
    from importlib.metadata import version
    return version("llama-cpp-python")


@functools.cache
def loaded_engine() -> dict[str, object]:
    """The llama.cpp build actually loaded, as a prompt-cache entry is keyed on: the bindings'
    version, their KV-state format, and every llama/ggml library in the folder the bindings
    loaded from (LLAMA_CPP_LIB_PATH's, else the wheel's) by name, size and time, so a swapped or
    rebuilt library never restores states another one saved."""
    from llama_cpp import llama_cpp as bindings
    folder = Path(bindings._base_path)
    libraries = sorted([p.name, st.st_size, st.st_mtime_ns]
                       for p in folder.iterdir() if p.name.startswith(_ENGINE_LIBRARIES)
                       and p.is_file() for st in (p.stat(),))
    return {"bindings": engine_version(), "state_seq_version": bindings.LLAMA_STATE_SEQ_VERSION,
            "libraries": libraries}


def engine_ggml():
    """ggml's functions as libllama reaches them: looked up through libllama's own handle, so in
    the libggml it was linked with. Not by loading libggml.so from its folder: a wheel cannot hold
    symlinks, so libggml.so and the libggml.so.0 libllama loads are two copies of one file, two
    libraries with two device registries, and a worker registered in one is not in the other."""
    from llama_cpp import llama_cpp
    return llama_cpp._lib
