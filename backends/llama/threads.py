"""One long-lived ggml CPU thread pool per thread count, attached to every llama.cpp context.

Where ggml is built without OpenMP (macOS's clang has none, for one), a context with no pool
attached makes ggml start and join fresh worker threads on every `llama_decode` call — once per
generated token. llama-bench and llama.cpp's own tools attach a persistent pool whose workers poll
briefly for the next graph instead; so do we. Where ggml uses OpenMP (llama-cpp-python built from
source on Linux links libgomp), OpenMP keeps its own team of threads alive between calls and the
pool only carries ggml's settings, so attaching it changes nothing measurable there (2 threads on
the build machine: within the noise).

llama-cpp-python binds neither the pool functions nor `llama_attach_threadpool`, so they are bound
here: the pool constructor through ggml's backend registry (as llama-bench does, so it is found
whether the CPU backend is linked in or loaded as a module), the rest on the libllama the package
loaded and the libggml beside it. The pools live as long as the process; contexts of one process
(a target and its draft model) share one, which is safe because they never decode at the same time.
A context that may decode while another does (the server's embedding context beside its generating
one) must not share it: two graphs computed on one pool overwrite each other's plan and barriers
(measured: a greedy chat answer turned to garbage while embeddings were computed), so it is
detached from the pool (`detach_pool`) and ggml gives each of its decodes a pool of its own.
"""

from __future__ import annotations

import ctypes
import functools

_MAX_THREADS = 512                  # GGML_MAX_N_THREADS: the length of the cpumask array
_DEVICE_TYPE_CPU = 0                # GGML_BACKEND_DEVICE_TYPE_CPU


class ThreadpoolParams(ctypes.Structure):
    """struct ggml_threadpool_params (ggml.h)."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * _MAX_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),        # enum ggml_sched_priority
        ("poll", ctypes.c_uint32),     # 0: workers sleep at once, 100: they spin hardest
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


class _PoolApi:
    def __init__(self) -> None:
        from llama_cpp import _ctypes_extensions, llama_cpp
        llama = llama_cpp._lib
        # The libggml beside the libllama actually loaded (LLAMA_CPP_LIB_PATH may point to another
        # build than the package's own): a pool from one ggml build must not go to another's context.
        ggml = _ctypes_extensions.load_shared_library("ggml", llama_cpp._base_path)

        def bind(lib, name, restype, *argtypes):
            return ctypes.CFUNCTYPE(restype, *argtypes)((name, lib))
        self.params_default = bind(ggml, "ggml_threadpool_params_default", ThreadpoolParams,
                                   ctypes.c_int)
        self.attach = bind(llama, "llama_attach_threadpool", None,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        self.detach = bind(llama, "llama_detach_threadpool", None, ctypes.c_void_p)
        device = bind(ggml, "ggml_backend_dev_by_type", ctypes.c_void_p, ctypes.c_int)(
            _DEVICE_TYPE_CPU)
        if not device:
            raise OSError("this llama.cpp build has no CPU backend device")
        registry = bind(ggml, "ggml_backend_dev_backend_reg", ctypes.c_void_p, ctypes.c_void_p)(
            device)
        address = bind(ggml, "ggml_backend_reg_get_proc_address", ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_char_p)(registry, b"ggml_threadpool_new")
        if not address:
            raise OSError("this llama.cpp build's CPU backend has no ggml_threadpool_new")
        self.new = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(ThreadpoolParams))(address)


@functools.lru_cache(maxsize=1)
def _api() -> _PoolApi | None:
    try:
        return _PoolApi()
    except (AttributeError, OSError, ImportError, RuntimeError):
        return None    # an engine build without these: llama.cpp falls back to per-call threads


@functools.lru_cache(maxsize=None)
def _pool(n_threads: int) -> int | None:
    api = _api()
    if api is None:
        return None
    params = api.params_default(n_threads)     # llama-bench's defaults: normal priority, poll 50
    return api.new(ctypes.byref(params)) or None


def attach_shared_pool(ctx, n_threads: int) -> int | None:
    """Attach this process's pool of `n_threads` workers to a llama_context and return its address;
    None where the engine offers no pool (ggml then makes threads per call, or OpenMP does)."""
    pool = _pool(n_threads)
    if pool is not None:
        _api().attach(ctypes.cast(ctx, ctypes.c_void_p), pool, None)   # NULL: same pool for batches
    return pool



def detach_pool(ctx) -> None:
    """Detach the shared pool from a llama_context (see the module's notes): each of its decodes
    then runs on a pool of its own (OpenMP's team, or threads made for the call)."""
    api = _api()
    if api is not None:
        api.detach(ctypes.cast(ctx, ctypes.c_void_p))
