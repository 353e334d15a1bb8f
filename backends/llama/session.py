"""llama.cpp backend through llama-cpp-python's low-level C API.

We drive `llama_decode` with our own batches and read logits in place as a numpy view: the high-level
`Llama` class samples in Python over the whole vocabulary each token, which runs Gemma 3 (262k
vocabulary) at a fifth of llama.cpp's speed.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from localinfer.backends import LoadOptions, context_length
from localinfer.backends.llama.devices import model_offload, uses_weight_buffers
from localinfer.backends.llama.engine import engine, init_engine, loaded_engine
from localinfer.backends.llama.kv import kv_cache_types, kv_label, kv_path, steers
from localinfer.backends.llama import rpc, steer
from localinfer.backends.llama.overrides import CpuOverrides
from localinfer.backends.llama.threads import attach_shared_pool
from localinfer.backends.llama.vocab import GGUFVocabulary
from localinfer.errors import ContextOverflow, LocalinferError, ModelLoadError
from localinfer.gguf.checks import check_model
from localinfer.machine import default_threads

MAX_OUTPUTS = 64              # most positions whose logits one llama_decode call returns


class LlamaCppSession(GGUFVocabulary):
    """One llama.cpp model and context holding a single sequence (seq_id 0)."""

    def __init__(self, path: Path, options: LoadOptions) -> None:
        lib = engine()
        # Clear errors for non-GGUF, truncated and damaged files, and for the values llama.cpp
        # would abort the process on, before llama.cpp sees the file.
        check_model(path)
        self._path, self._options = path, options
        log = init_engine(options.verbose)
        rpc.connect()           # the workers asked for: devices llama.cpp's selection takes
        mparams = lib.llama_model_default_params()
        # The fit's placement (or --gpu-layers); llama.cpp's own default puts every layer on the GPU.
        mparams.n_gpu_layers = max(-1, min(options.gpu_layers, 2 ** 31 - 1))
        mparams.use_extra_bufts = uses_weight_buffers()
        # The fit's (or --cpu-moe's) experts kept in host memory, and with RPC workers the output
        # layer (overrides.OUTPUT_PATTERN); read during the load, kept with the model all the same.
        remote = rpc.in_use() and options.gpu_layers != 0
        self._overrides = CpuOverrides(max(options.cpu_moe, 0), output=remote) \
            if options.cpu_moe > 0 or remote else None
        if self._overrides is not None:
            mparams.tensor_buft_overrides = self._overrides.address
        self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            reason = log.last_error() or "llama.cpp could not load it"
            raise ModelLoadError(f"cannot load {path.name}: {reason}")
        self._init_vocabulary(path)
        rpc.harden_sockets()
        self.offload = model_offload(self._model, options.gpu_layers, max(options.cpu_moe, 0))
        # A device other than the CPU copies the logits back asynchronously (a GPU, an RPC
        # worker): the reused view below must wait for that copy, which llama.cpp's getters do.
        self._sync_logits = self.offload.gpu_layers > 0
        trained = lib.llama_model_n_ctx_train(self._model)
        n_ctx = context_length(options.n_ctx, trained)
        self._ctx = self._steered_context(options, n_ctx)
        if not self._ctx:
            self.close()     # frees the model, once: __del__ calls close() again
            raise ModelLoadError(f"cannot create a context of {n_ctx} tokens: {log.last_error()}")
        self.kv_type = kv_label(options, self._steer is not None)   # in the exactness probe's key
        self.kv_path = kv_path(self._kv_types, self._steer is not None)  # what `bench` reports
        self.threadpool = attach_shared_pool(self._ctx, self.n_threads)   # address, or None
        self.n_ctx = lib.llama_n_ctx(self._ctx)
        self.n_batch = lib.llama_n_batch(self._ctx)
        self._mem = lib.llama_get_memory(self._ctx)
        # Tokens a sliding-window layer attends to; 0 = none. The prompt cache restores such a
        # model's states only whole, never trimmed (the saved state lacks cells out of the window).
        self.sliding_window = lib.llama_model_n_swa(self._model)
        self._n_past, self._unsure, self._trim_floor = 0, False, 0    # see n_past and restore
        self._batch = self._new_batch(self.n_batch)
        self._logits_type = ctypes.c_float * self.n_vocab
        self._row0_view: np.ndarray | None = None    # see _last_logits
        self.media = None        # a projector (mtmd.attach) when images or audio may come
        if options.mmproj:
            from localinfer.backends.llama.mtmd import attach
            try:
                attach(self, Path(options.mmproj), verbose=options.verbose)
            except Exception:
                self.close()
                raise

    # -- loading ---------------------------------------------------------------------------------
    def _steered_context(self, options: LoadOptions, n_ctx: int):
        """A context with the steered f16/f16 cache where it can be had (steer.py), else the
        cache kv.py keeps without steering."""
        self._steer = None
        if steers(options):
            ctx = self._new_context(options, n_ctx, steered=True)
            backend = steer.find(ctx) if ctx else None
            if backend is not None:
                self._steer = steer.Steer(backend)
                return ctx
            if ctx:
                engine().llama_free(ctx)
        return self._new_context(options, n_ctx, steered=False)

    def _new_context(self, options: LoadOptions, n_ctx: int, *, steered: bool):
        lib = engine()
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = options.n_batch
        cparams.n_ubatch = options.n_batch
        # llama.cpp sizes its compute buffer for n_outputs_max rows of logits per ubatch; with Gemma 3's
        # 262k vocabulary the default (one row per batch token) reserves 512 MB we never use.
        cparams.n_outputs_max = MAX_OUTPUTS
        threads = options.n_threads or default_threads()
        self.n_threads = threads
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        # Keep every sliding-window layer's cache full size (Gemma 3): only then can KV entries be
        # trimmed and a saved state be cut short and continued (the prompt cache relies on both).
        cparams.swa_full = True
        # Several sequences share one pool of n_ctx cells (batched.py), a short one leaving room
        # to a long one.
        cparams.n_seq_max = options.n_seq
        cparams.kv_unified = options.n_seq > 1
        self._rope = _stretch(cparams, options.rope_scaling, n_ctx,
                              lib.llama_model_n_ctx_train(self._model))
        self._kv_types = cparams.type_k, cparams.type_v = kv_cache_types(options, steered)
        # Flash attention, always: the kernels that read a quantized V cache, and the ones whose
        # row-by-row path is batch-invariant (see kv.py).
        cparams.flash_attn_type = 1    # LLAMA_FLASH_ATTN_TYPE_ENABLED
        return lib.llama_init_from_model(self._model, cparams)

    def _new_batch(self, size: int):
        """A batch whose every token belongs to sequence 0, set once here rather than per decode."""
        batch = engine().llama_batch_init(size, 0, 1)
        for i in range(size):
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
        # The arrays a decode fills, fetched once: each struct field read builds a ctypes object.
        self._batch_arrays = (batch.token, batch.pos, batch.logits)
        return batch

    # -- evaluation ------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Tokens in the KV cache; asked of llama.cpp after a change that did not count its cells
        (Ctrl-C during llama_decode raises as the call returns: the cells written, not counted)."""
        if self._unsure:
            self._n_past, self._unsure = engine().llama_memory_seq_pos_max(self._mem, 0) + 1, False
        return self._n_past

    def eval(self, tokens: Sequence[int], *, logits: Literal["last", "all", "none"] = "last") \
            -> np.ndarray | None:
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextOverflow(
                f"the context is full ({self.n_ctx} tokens); raise --ctx or shorten the input")
        if logits == "none":    # text between media (engine/media.py): no output row computed
            for start in range(0, len(tokens), self.n_batch):
                self._decode(tokens[start:start + self.n_batch], want_all=False, want_last=False)
            return None
        rows = []
        step = self.n_batch if logits == "last" else min(self.n_batch, MAX_OUTPUTS)
        for start in range(0, len(tokens), step):
            chunk = tokens[start:start + step]
            last_chunk = start + step >= len(tokens)
            self._decode(chunk, want_all=logits == "all", want_last=last_chunk)
            if logits == "all":
                rows.append(self._all_logits(len(chunk)).copy() if not last_chunk
                            else self._all_logits(len(chunk)))
        if logits == "all":
            return rows[0] if len(rows) == 1 else np.concatenate(rows)
        return self._last_logits()

    def _decode(self, chunk: Sequence[int], *, want_all: bool, want_last: bool) -> None:
        batch, token_at, pos_at, output_at = self._batch, *self._batch_arrays
        n = len(chunk)
        pos = self.n_past
        for i, token in enumerate(chunk):
            token_at[i] = token
            pos_at[i] = pos + i
            output_at[i] = want_all
        if want_last:
            output_at[n - 1] = True
        if want_all and n > 1:
            self._row0_view = None       # more output rows than before may move the output buffer
        batch.n_tokens = n
        self.steer_rows(n)
        self._unsure = True
        rc = engine().llama_decode(self._ctx, batch)
        if rc != 0:     # left unsure: a failed decode may have kept some of its cells
            raise LocalinferError(f"llama_decode failed with code {rc} at position {pos}")
        self._n_past, self._unsure = pos + n, False

    def advance_unsure(self) -> None:
        """Before a decode another module makes (mtmd.py's embeddings): see n_past."""
        self._unsure = True

    def advanced(self, n_past: int) -> None:
        """After that decode: n_past cells held; the output buffer may have moved."""
        self._n_past, self._unsure, self._row0_view = n_past, False, None

    def steer_rows(self, n: int) -> None:
        """Before a decode of n rows: the kernels a graph that tall takes (steer.py)."""
        if self._steer is not None:
            self._steer.rows(n)

    def _last_logits(self) -> np.ndarray:
        """Logits of a decode that output one row, as a view into llama.cpp's output buffer.

        One output lands in row 0 of that buffer, which llama.cpp reallocates only when a decode
        needs more rows than it holds, never for one row. So the view is made once and reused until
        a decode with several output rows: right after a decode the caches are cold and each ctypes
        call costs 20-30 µs, about 0.3% of a SmolLM2 step. Where layers sit on another device, the
        view is read after llama_synchronize: the copy into that buffer may still be under way.
        """
        if self._sync_logits:
            engine().llama_synchronize(self._ctx)
        if self._row0_view is None:
            ptr = engine().llama_get_logits_ith(self._ctx, -1)
            addr = ctypes.cast(ptr, ctypes.c_void_p).value
            self._row0_view = np.frombuffer(self._logits_type.from_address(addr), dtype=np.float32)
        return self._row0_view

    def _all_logits(self, n_rows: int) -> np.ndarray:
        ptr = engine().llama_get_logits(self._ctx)
        flat = np.ctypeslib.as_array(ptr, shape=(n_rows * self.n_vocab,))
        return flat.reshape(n_rows, self.n_vocab)

    # -- KV cache --------------------------------------------------------------------------------
    def trim(self, n_keep: int) -> bool:
        if n_keep >= self.n_past:
            return True
        if n_keep < self._trim_floor:   # cells it would need were not in the restored state
            return False
        self._unsure = True             # see n_past
        if not engine().llama_memory_seq_rm(self._mem, 0, n_keep, -1):
            return False
        self._n_past, self._unsure = n_keep, False
        return True

    def reset(self) -> None:
        self._unsure = True
        engine().llama_memory_clear(self._mem, True)
        self._n_past, self._trim_floor, self._unsure = 0, 0, False

    def state(self) -> bytes:
        # For a sliding-window model (Gemma 3) this leaves out the cells already outside the window:
        # a restored state continues exactly, but cannot be trimmed back (see sliding_window).
        lib = engine()
        size = lib.llama_state_seq_get_size(self._ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = lib.llama_state_seq_get_data(self._ctx, buf, size, 0)
        # string_at copies in C; slicing a ctypes array would build a Python int per byte (seconds).
        return ctypes.string_at(buf, written)

    def state_identity(self) -> dict[str, object]:
        """Everything that shapes the KV state: a saved state is restored only into an equal one
        (not n_ctx: a state restores exactly into any context with room for its cells)."""
        st = self._path.stat()
        return {"backend": "llama.cpp", "engine": loaded_engine(), "model": str(self._path.resolve()),
                "model_size": st.st_size, "model_mtime_ns": st.st_mtime_ns,
                "n_batch": self.n_batch, "n_ubatch": engine().llama_n_ubatch(self._ctx),
                "kv_types": list(self._kv_types), "steered": self._steer is not None,
                "swa_full": True, **({"rope": list(self._rope)} if self._rope else {}),
                **self.offload.identity()}

    def restore(self, blob: bytes, n_past: int) -> None:
        lib = engine()
        self.reset()
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        rigid = self.sliding_window and n_past > self.sliding_window    # floor before the cells land
        self._trim_floor, self._unsure = (n_past - 1 if rigid else 0), True
        if lib.llama_state_seq_set_data(self._ctx, buf, len(blob), 0) != len(blob):
            self.reset()
            raise LocalinferError("could not restore the KV-cache state")
        self._n_past, self._unsure = n_past, False

    def close(self) -> None:
        lib = engine()
        if getattr(self, "media", None) is not None:
            self.media.close()
            self.media = None
        if getattr(self, "_ctx", None):
            lib.llama_batch_free(self._batch)
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _stretch(cparams, scaling: str, n_ctx: int, trained: int) -> tuple[str, float] | None:
    """RoPE scaling asked for (LoadOptions.rope_scaling): positions up to n_ctx squeezed into the
    trained range, YaRN's attention correction from the trained length. It shapes every K cell,
    so it is part of the state's identity; None when not asked or nothing is stretched."""
    if not scaling or trained <= 0 or n_ctx <= trained:
        return None
    lib = engine()
    kinds = {"yarn": lib.LLAMA_ROPE_SCALING_TYPE_YARN, "linear": lib.LLAMA_ROPE_SCALING_TYPE_LINEAR}
    cparams.rope_scaling_type = kinds[scaling]
    cparams.rope_freq_scale = trained / n_ctx
    cparams.yarn_orig_ctx = trained
    return scaling, trained / n_ctx
