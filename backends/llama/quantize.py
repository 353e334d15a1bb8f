"""llama.cpp's own quantizer (`llama_model_quantize`), called through ctypes on the engine library.

Only the four functions the quantizer needs are bound, straight on the libllama that
llama-cpp-python ships, without importing the llama_cpp package: that import (numpy, jinja2 and its
high-level API) would cost `localinfer quantize` a tenth of a second that `llama-quantize` does not
pay. The struct follows llama.h of the pinned llama-cpp-python; tests/test_quantize.py checks it
against the package's own declaration. Where the library is not at its usual place, the package
loads it instead.

The call runs on a worker thread so that Ctrl-C reaches Python at once: the caller removes the
partial file and exits while llama.cpp is still busy. llama.cpp reports per-tensor progress through
its log callback in fragments; they are joined into whole lines for the caller.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from localinfer.errors import LocalinferError

OnLine = Callable[[str], None]
_abandoned: list = []     # arguments of interrupted calls still running on their thread
_M_ARENA_MAX = -8         # glibc mallopt parameter


class QuantizeParams(ctypes.Structure):
    """struct llama_model_quantize_params; the pointer members as void pointers."""

    _fields_ = [
        ("nthread", ctypes.c_int32),
        ("ftype", ctypes.c_int),
        ("output_tensor_type", ctypes.c_int),
        ("token_embedding_type", ctypes.c_int),
        ("allow_requantize", ctypes.c_bool),
        ("quantize_output_tensor", ctypes.c_bool),
        ("only_copy", ctypes.c_bool),
        ("pure", ctypes.c_bool),
        ("keep_split", ctypes.c_bool),
        ("dry_run", ctypes.c_bool),
        ("imatrix", ctypes.c_void_p),         # llama_model_imatrix_data[], name NULL ends it
        ("kv_overrides", ctypes.c_void_p),    # llama_model_kv_override[], key "" ends it
        ("tt_overrides", ctypes.c_void_p),
        ("prune_layers", ctypes.c_void_p),
        ("max_buf_size", ctypes.c_size_t),
    ]


class _ImatrixEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("data", ctypes.POINTER(ctypes.c_float)),
                ("size", ctypes.c_size_t)]


class _KvValue(ctypes.Union):
    _fields_ = [("val_i64", ctypes.c_int64), ("val_f64", ctypes.c_double),
                ("val_bool", ctypes.c_bool), ("val_str", ctypes.c_char * 128)]


class _KvOverride(ctypes.Structure):
    _fields_ = [("tag", ctypes.c_int), ("key", ctypes.c_char * 128), ("value", _KvValue)]


_LogCallback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


@dataclass
class QuantizeCall:
    """Everything one llama_model_quantize call needs, as plain Python values."""

    src: Path
    dst: Path | None                      # None for a dry run
    ftype: int                            # llama_ftype
    threads: int = 0                      # 0: llama.cpp's default (all hardware threads)
    allow_requantize: bool = False
    imatrix: dict | None = None           # tensor name -> numpy float32 vector
    # Written into the output's metadata as llama-quantize does (imatrix provenance).
    kv_overrides: list[tuple[str, int | str]] = field(default_factory=list)


class QuantizeFailed(LocalinferError):
    """llama.cpp refused or failed; `reason` is its own words."""

    def __init__(self, src: Path, reason: str) -> None:
        super().__init__(f"llama.cpp could not quantize {src.name}: {reason}")
        self.reason = reason


class _Engine:
    """The few libllama functions the quantizer needs, bound with their own prototypes so that
    nothing is changed on function objects the llama_cpp package may share."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        def bind(name: str, restype, *argtypes):
            return ctypes.CFUNCTYPE(restype, *argtypes)((name, lib))
        self.default_params = bind("llama_model_quantize_default_params", QuantizeParams)
        self.quantize = bind("llama_model_quantize", ctypes.c_uint32, ctypes.c_char_p,
                             ctypes.c_char_p, ctypes.POINTER(QuantizeParams))
        self.log_get = bind("llama_log_get", None, ctypes.POINTER(_LogCallback),
                            ctypes.POINTER(ctypes.c_void_p))
        self.log_set = bind("llama_log_set", None, _LogCallback, ctypes.c_void_p)
        bind("llama_backend_init", None)()


@functools.lru_cache(maxsize=1)
def _engine() -> _Engine:
    return _Engine(_load_library())


def _load_library() -> ctypes.CDLL:
    from localinfer import settings
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise LocalinferError("llama-cpp-python is not installed: pip install llama-cpp-python")
    name = {"linux": "libllama.so", "darwin": "libllama.dylib"}.get(sys.platform)
    path = Path(next(iter(spec.submodule_search_locations))) / "lib" / (name or "")
    if name and path.is_file() and settings.load().engine_lib_dir is None:
        return ctypes.CDLL(str(path))
    import llama_cpp  # elsewhere (Windows, LLAMA_CPP_LIB_PATH): the package's own loader
    return llama_cpp.llama_cpp._lib


class _LogCapture:
    """Collects llama.cpp's log while one call runs: whole lines to `on_line`, the last ones kept
    for the error message."""

    _CONT = 5                 # GGML_LOG_LEVEL_CONT: a fragment continuing the previous line

    def __init__(self, on_line: OnLine) -> None:
        self.on_line, self.buffer = on_line, ""
        self.recent: deque[str] = deque(maxlen=20)
        self.callback = _LogCallback(self._on_fragment)   # kept alive as long as llama.cpp may call

    def _on_fragment(self, _level: int, text: bytes, _user) -> None:
        self.buffer += text.decode("utf-8", "replace")
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            if line.strip():
                self.recent.append(line.strip())
                self.on_line(line)

    def reason(self) -> str:
        for line in reversed(self.recent):
            if "failed to quantize:" in line:
                return line.split("failed to quantize:", 1)[1].strip()
        return self.recent[-1] if self.recent else "unknown error"


def quantize(call: QuantizeCall, on_line: OnLine, *, dry_run: bool = False) -> None:
    """Run the quantizer; raise QuantizeFailed with llama.cpp's reason when it fails."""
    engine = _engine()
    params, keep_alive = _params(engine, call, dry_run)
    dst = b"" if call.dst is None else str(call.dst).encode()
    capture = _LogCapture(on_line)
    outcome: dict[str, int] = {}

    def work() -> None:
        outcome["rc"] = engine.quantize(str(call.src).encode(), dst, ctypes.byref(params))

    # Whoever logged before (the llama.cpp backend's router) gets the log back afterwards.
    previous, previous_data = _LogCallback(), ctypes.c_void_p()
    engine.log_get(ctypes.byref(previous), ctypes.byref(previous_data))
    engine.log_set(capture.callback, None)
    _share_the_main_malloc_arena()
    worker = threading.Thread(target=work, name="llama-quantize", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)           # short waits: KeyboardInterrupt is delivered between them
    except BaseException:
        # llama.cpp keeps running until the process exits: its buffers and our callback must
        # stay alive till then, and its lines go on to our capture, not to a restored logger.
        _abandoned.append((params, keep_alive, capture))
        raise
    engine.log_set(previous, previous_data)
    if outcome.get("rc", 1) != 0:
        raise QuantizeFailed(call.src, capture.reason())


def _share_the_main_malloc_arena() -> None:
    """Let threads started from now on allocate from glibc's main arena, as llama-quantize's do.

    Off the main thread glibc gives a thread an arena of its own, made of 64 MB heaps that are
    grown and trimmed with mprotect and madvise. The quantizer allocates and frees a buffer per
    tensor; in such an arena the pages go back to the kernel and are faulted in again for the next
    tensor: measured 0.3-0.8 s more system time than llama-quantize on a 2 s Gemma 3 270M run, all
    of it gone with one arena. The setting holds for the rest of the process (a `run` that
    quantizes to fit decodes afterwards with it too); ggml's compute threads do not allocate while
    they work, so decoding should not feel it (not measured). Only glibc has mallopt; elsewhere
    this does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass                       # not glibc (e.g. musl): nothing to tune


def _params(engine: _Engine, call: QuantizeCall, dry_run: bool):
    params = engine.default_params()
    params.nthread = call.threads
    params.ftype = call.ftype
    params.allow_requantize = call.allow_requantize
    params.dry_run = dry_run
    keep_alive: list = []                 # ctypes buffers that must outlive the call
    if call.imatrix:
        entries, held = _imatrix_array(call.imatrix)
        params.imatrix = ctypes.cast(entries, ctypes.c_void_p)
        keep_alive.append(held)
    if call.kv_overrides:
        overrides = _overrides(call.kv_overrides)
        params.kv_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        keep_alive.append(overrides)
    return params, keep_alive


def _imatrix_array(imatrix: dict):
    import numpy as np  # only with an importance matrix, which is numpy data already
    entries = (_ImatrixEntry * (len(imatrix) + 1))()                 # last one: the terminator
    held = [entries]
    for i, (name, values) in enumerate(imatrix.items()):
        data = np.ascontiguousarray(values, dtype=np.float32)
        held.append(data)
        entries[i].name = name.encode()
        entries[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = data.size
    return entries, held


_TAG_INT, _TAG_STR = 0, 3     # llama_model_kv_override_type


def _overrides(pairs: list[tuple[str, int | str]]):
    array = (_KvOverride * (len(pairs) + 1))()                       # key "" terminates
    for slot, (key, value) in zip(array, pairs):
        slot.key = key.encode()
        if isinstance(value, int):
            slot.tag, slot.value.val_i64 = _TAG_INT, value
        else:
            slot.tag, slot.value.val_str = _TAG_STR, value.encode()[:127]
    return array
