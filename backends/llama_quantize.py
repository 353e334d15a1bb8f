"""llama.cpp's own quantizer (`llama_model_quantize`), driven through llama-cpp-python's ctypes API.

The call runs on a worker thread so that Ctrl-C reaches Python at once: the caller removes the
partial file and exits while llama.cpp is still busy. llama.cpp reports per-tensor progress through
its log callback in fragments; they are joined into whole lines for the caller.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from localinfer.backends import llama_cpp
from localinfer.errors import LocalinferError

OnLine = Callable[[str], None]
_abandoned: list = []     # arguments of interrupted calls still running on their thread


@dataclass
class QuantizeCall:
    """Everything one llama_model_quantize call needs, as plain Python values."""

    src: Path
    dst: Path | None                      # None for a dry run
    ftype: int                            # llama_ftype
    threads: int = 0                      # 0: llama.cpp's default (all hardware threads)
    allow_requantize: bool = False
    imatrix: dict[str, np.ndarray] | None = None
    # Written into the output's metadata as llama-quantize does (imatrix provenance).
    kv_overrides: list[tuple[str, int | str]] = field(default_factory=list)


class _LineJoiner:
    """llama.cpp logs a tensor's line in several fragments; hand whole lines on."""

    def __init__(self, on_line: OnLine) -> None:
        self.on_line, self.buffer = on_line, ""

    def __call__(self, _level: int, fragment: str) -> None:
        self.buffer += fragment
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            if line.strip():
                self.on_line(line)


def quantize(call: QuantizeCall, on_line: OnLine, *, dry_run: bool = False) -> None:
    """Run the quantizer; raise LocalinferError with llama.cpp's reason when it fails."""
    lib = llama_cpp._lib()
    log = llama_cpp._init(verbose=False)
    params, keep_alive = _params(lib, call, dry_run)
    dst = b"" if call.dst is None else str(call.dst).encode()
    outcome: dict[str, int] = {}

    def work() -> None:
        outcome["rc"] = lib.llama_model_quantize(str(call.src).encode(), dst, ctypes.byref(params))

    log.listener = _LineJoiner(on_line)
    worker = threading.Thread(target=work, name="llama-quantize", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)           # short waits: KeyboardInterrupt is delivered between them
    except BaseException:
        # llama.cpp keeps running until the process exits: its buffers must stay alive till then.
        _abandoned.append((params, keep_alive))
        raise
    finally:
        log.listener = None
    if outcome.get("rc", 1) != 0:
        raise LocalinferError(f"llama.cpp could not quantize {call.src.name}: {_reason(log)}")


def _reason(log) -> str:
    for line in reversed(log.recent):
        if "failed to quantize:" in line:
            return line.split("failed to quantize:", 1)[1].strip()
    return log.last_error() or "unknown error"


def _params(lib, call: QuantizeCall, dry_run: bool):
    params = lib.llama_model_quantize_default_params()
    params.nthread = call.threads
    params.ftype = call.ftype
    params.allow_requantize = call.allow_requantize
    params.dry_run = dry_run
    keep_alive: list = []                 # ctypes buffers that must outlive the call
    if call.imatrix:
        params.imatrix, held = _imatrix_array(lib, call.imatrix)
        keep_alive.append(held)
    if call.kv_overrides:
        params.kv_overrides = _overrides(lib, call.kv_overrides)
        keep_alive.append(params.kv_overrides)
    return params, keep_alive


def _imatrix_array(lib, imatrix: dict[str, np.ndarray]):
    entries = (lib.llama_model_imatrix_data * (len(imatrix) + 1))()   # last one: the terminator
    held = [entries]
    for i, (name, values) in enumerate(imatrix.items()):
        data = np.ascontiguousarray(values, dtype=np.float32)
        held.append(data)
        entries[i].name = name.encode()
        entries[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = data.size
    return entries, held


_TAG_INT, _TAG_STR = 0, 3     # llama_model_kv_override_type


def _overrides(lib, pairs: list[tuple[str, int | str]]):
    array = (lib.llama_model_kv_override * (len(pairs) + 1))()      # key "" terminates
    for slot, (key, value) in zip(array, pairs):
        slot.key = key.encode()
        if isinstance(value, int):
            slot.tag, slot.value.val_i64 = _TAG_INT, value
        else:
            slot.tag, slot.value.val_str = _TAG_STR, value.encode()[:127]
    return array
