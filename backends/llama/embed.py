"""Embeddings through llama.cpp's embedding mode: several inputs in one llama_decode, one pooled,
L2-normalised vector each.

The context is made with `embeddings` on and the model's own pooling (`{arch}.pooling_type` in
the GGUF; mean for a generative model that declares none, as `llama-server --embeddings
--pooling mean` pools it). llama.cpp pools per micro-batch, so a sequence split over two would
be pooled over its second half only: the context's micro-batch is its whole batch (n_ubatch =
n_batch = n_ctx), and every decode holds whole inputs, each a sequence of its own (seq ids 0..n-1,
positions from 0), packed until the token budget or the sequence count is reached. After each
decode the cells are cleared: inputs never see one another, and an input's vector is the same
whichever inputs share its decode (the attention kernel below; tests/test_embed.py checks it to
1e-5), and across runs it is identical.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from localinfer.backends import LoadOptions
from localinfer.backends.llama.engine import engine
from localinfer.backends.llama.kv import kv_cache_types
from localinfer.backends.llama.session import LlamaCppSession
from localinfer.backends.llama.threads import detach_pool
from localinfer.errors import LocalinferError, ModelLoadError, UsageError
from localinfer.machine import default_threads

POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
MEAN, RANK = 1, 4
MAX_SEQUENCES = 256          # llama.cpp's LLAMA_MAX_SEQ


def pooling_of(metadata: dict[str, str], architecture: str) -> int:
    """The pooling a model's GGUF declares ({arch}.pooling_type), mean where it declares none
    (or none-pooling: per-token vectors are not an embedding of the text)."""
    value = metadata.get(f"{architecture}.pooling_type", "")
    try:
        declared = int(value)
    except ValueError:
        return MEAN
    return declared if declared in POOLING and declared != 0 else MEAN


class _EmbeddingContext(LlamaCppSession):
    """The model loaded as the llama.cpp session loads it (file checks, GPU placement,
    vocabulary), with a context in embedding mode instead of a generating one."""

    def __init__(self, path: Path, options: LoadOptions, n_seq: int) -> None:
        self._n_seq = n_seq
        try:
            super().__init__(path, options)
        except ModelLoadError:
            self.close()
            raise
        # The server decodes with its generating context while this one embeds: the process's
        # shared thread pool must not run both graphs at once (threads.py).
        detach_pool(self._ctx)
        self.threadpool = None

    def _steered_context(self, options: LoadOptions, n_ctx: int):
        """Never steered: the bf16 K cache keeps every row of every input off the tiled kernel."""
        self._steer = None
        lib = engine()
        self.pooling = pooling_of(self.metadata, self.architecture)
        if self.pooling == RANK:
            raise ModelLoadError(f"{self._path.name} is a reranker (pooling: rank): it scores "
                                 "pairs of texts and gives no embeddings")
        if lib.llama_model_has_encoder(self._model) and lib.llama_model_has_decoder(self._model):
            raise ModelLoadError(f"{self._path.name} is an encoder-decoder model; llama.cpp "
                                 "computes no embeddings for those")
        cparams = lib.llama_context_default_params()
        cparams.embeddings = True
        cparams.pooling_type = self.pooling
        # One micro-batch per decode: pooling sees every token of each input at once.
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
        cparams.n_seq_max = self._n_seq
        cparams.kv_unified = True        # any one input may take every cell
        threads = options.n_threads or default_threads()
        self.n_threads = cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        # Flash attention with the session's 16-bit cache, bf16 K on a CPU build (kv.py): twice
        # the inputs/s of attention without it (where every token's scores span every cell of
        # the decode), and f16 K would let batches of 64 rows or more take the tiled kernel, whose
        # sums moved vectors by 8e-3 from a lone input's on SmolLM2 (docs/embeddings.md).
        cparams.flash_attn_type = 1      # LLAMA_FLASH_ATTN_TYPE_ENABLED
        self._kv_types = cparams.type_k, cparams.type_v = kv_cache_types(
            replace(options, kv_type="f16", long_prompt=False), steered=False)
        return lib.llama_init_from_model(self._model, cparams)

    def _new_batch(self, size: int):
        batch = engine().llama_batch_init(size, 0, 1)
        self._batch_arrays = (batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits)
        return batch


class LlamaEmbedder:
    """A model loaded for embeddings: `embed(token lists)` gives one unit vector per input.

    `options.n_ctx` is the most tokens one decode holds (and so the longest input); `n_seq` the
    most inputs one decode holds."""

    def __init__(self, path: Path, options: LoadOptions, n_seq: int) -> None:
        if not 1 <= n_seq <= MAX_SEQUENCES:
            raise UsageError(f"the batch must be 1 to {MAX_SEQUENCES} inputs, not {n_seq}")
        if options.n_ctx < 1:
            raise UsageError("an embedding context needs its size in tokens")
        # llama.cpp reserves its graph for n_seq sequences sharing a micro-batch evenly, and
        # aborts the process when they cannot (a batch of 3 in 512 tokens): round up.
        n_ctx = -(-options.n_ctx // n_seq) * n_seq
        self.session = _EmbeddingContext(path, replace(options, n_ctx=n_ctx, n_seq=n_seq), n_seq)
        lib = engine()
        s = self.session
        self.n_seq, self.n_ctx = n_seq, s.n_batch      # n_ctx is padded; the batch is not
        self.n_embd = lib.llama_model_n_embd_out(s._model)
        self.pooling = POOLING[lib.llama_pooling_type(s._ctx)]
        self.metadata, self.architecture = s.metadata, s.architecture
        self._vector_type = ctypes.c_float * self.n_embd

    def tokenize(self, text: str) -> list[int]:
        """The tokens of one input with the model's own BOS/EOS (CLS/SEP) rules; text that
        spells a control token stays text."""
        lib, s = engine(), self.session
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (lib.llama_token * capacity)()
        n = lib.llama_tokenize(s._vocab, data, len(data), buf, capacity, True, False)
        if n < 0:
            capacity = -n
            buf = (lib.llama_token * capacity)()
            n = lib.llama_tokenize(s._vocab, data, len(data), buf, capacity, True, False)
        return list(buf[:n])

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """One L2-normalised float32 row per input (each 1 to n_ctx tokens), in input order."""
        out = np.empty((len(inputs), self.n_embd), dtype=np.float32)
        start = 0
        while start < len(inputs):
            end, used = start, 0
            while end < len(inputs) and end - start < self.n_seq:
                n = len(inputs[end])
                if not 0 < n <= self.n_ctx:
                    raise UsageError(f"an input of {n} tokens (1 to {self.n_ctx} fit)")
                if used + n > self.n_ctx:
                    break
                used += n
                end += 1
            self._decode(inputs[start:end], out[start:end])
            start = end
        return out

    def _decode(self, inputs: Sequence[Sequence[int]], out: np.ndarray) -> None:
        lib, s = engine(), self.session
        batch = s._batch
        token_at, pos_at, n_seq_at, seq_at, output_at = s._batch_arrays
        n = 0
        for seq, tokens in enumerate(inputs):
            for pos, token in enumerate(tokens):
                token_at[n], pos_at[n], n_seq_at[n], seq_at[n][0] = token, pos, 1, seq
                output_at[n] = True          # pooled embeddings need every token's output
                n += 1
        batch.n_tokens = n
        rc = lib.llama_decode(s._ctx, batch)
        if s._mem:
            lib.llama_memory_clear(s._mem, False)     # the next decode starts on empty cells
        if rc != 0:
            raise LocalinferError(f"llama_decode failed with code {rc} embedding "
                                  f"{len(inputs)} inputs")
        for seq in range(len(inputs)):
            ptr = lib.llama_get_embeddings_seq(s._ctx, seq)
            if not ptr:
                raise LocalinferError(f"llama.cpp returned no embedding for sequence {seq}")
            addr = ctypes.cast(ptr, ctypes.c_void_p).value
            out[seq] = np.frombuffer(self._vector_type.from_address(addr), dtype=np.float32)
        norms = np.sqrt(np.einsum("ij,ij->i", out, out, dtype=np.float32))
        np.divide(out, norms[:, None], out=out, where=norms[:, None] > 0)

    def close(self) -> None:
        self.session.close()
