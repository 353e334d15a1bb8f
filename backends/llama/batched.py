"""Several sequences in one llama.cpp context: what continuous batching decodes with.

One model, one context with `n_seq` KV sequences (llama.cpp's multi-sequence batches; the cells
are one unified pool, so a short request leaves room to a long one). Each `decode` call is one
`llama_decode` over pieces of any sequences (a decode step of one token for each running request,
a chunk of a new request's prompt) and returns the logits of each piece's last token.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from localinfer.backends import LoadOptions, Piece
from localinfer.backends.llama.engine import engine
from localinfer.backends.llama.session import MAX_OUTPUTS, LlamaCppSession
from localinfer.errors import LocalinferError, UsageError

MAX_SEQUENCES = MAX_OUTPUTS        # every sequence may need one output row in the same decode


class SequenceBatch:
    """A loaded model whose context holds `n_seq` independent sequences (ids 0..n_seq-1): the
    llama.cpp backend's BatchSession."""

    def __init__(self, path: Path, options: LoadOptions, n_seq: int) -> None:
        if not 1 <= n_seq <= MAX_SEQUENCES:
            raise UsageError(f"--parallel must be between 1 and {MAX_SEQUENCES}")
        self.session = LlamaCppSession(path, replace(options, n_seq=n_seq))
        self.n_seq, self.n_ctx, self.n_batch = n_seq, self.session.n_ctx, self.session.n_batch
        lib = engine()
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        # The arrays a decode fills, fetched once: each struct field read builds a ctypes object.
        b = self._batch
        self._arrays = (b.token, b.pos, b.n_seq_id, b.seq_id, b.logits)
        self._mem = lib.llama_get_memory(self.session._ctx)

    def decode(self, pieces: Sequence[Piece]) -> list[np.ndarray | None]:
        """One llama_decode over every piece (at most n_batch tokens in all); for each piece in
        the order given, a copy of the logits after its last token (None where not wanted)."""
        lib, batch = engine(), self._batch
        token_at, pos_at, n_seq_at, seq_at, output_at = self._arrays
        n = 0
        for piece in pieces:
            last = len(piece.tokens) - 1
            for i, token in enumerate(piece.tokens):
                token_at[n], pos_at[n] = token, piece.pos + i
                n_seq_at[n], seq_at[n][0] = 1, piece.seq
                output_at[n] = piece.logits and i == last
                n += 1
        if not 0 < n <= self.n_batch:
            raise LocalinferError(f"a batch of {n} tokens (1 to {self.n_batch} fit)")
        batch.n_tokens = n
        # Kernels as each piece would get decoded alone, so that a request's text does not hang
        # on what it shares a batch with: a tall graph made of short pieces stays on the
        # reference kernels (steer.py), as each of those pieces would alone.
        self.session.steer_rows(max(len(piece.tokens) for piece in pieces))
        rc = lib.llama_decode(self.session._ctx, batch)
        if rc != 0:
            raise LocalinferError(f"llama_decode failed with code {rc}"
                                  + (" (the context is full)" if rc == 1 else ""))
        self.session._row0_view = None       # the single-sequence view's rows moved
        rows, end = [], 0
        for piece in pieces:
            end += len(piece.tokens)
            rows.append(self._row(end - 1) if piece.logits else None)
        return rows

    def decode_embd(self, seq: int, pos: int, embd: np.ndarray, *, causal: bool = True) -> None:
        """A medium's rows of input embeddings into `seq` from `pos`, in llama_decodes of their
        own (n_batch rows each, no logits), as `run` decodes them (mtmd.decode_embeddings)."""
        lib, ctx = engine(), self.session._ctx
        n, width = embd.shape
        step = self.n_batch
        batch = lib.llama_batch_init(min(step, n), width, 1)
        try:
            if not causal:          # the whole decode holds this medium's rows alone
                lib.llama_set_causal_attn(ctx, False)
            for start in range(0, n, step):
                rows = np.ascontiguousarray(embd[start:start + step], np.float32)
                count = len(rows)
                ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
                for i in range(count):
                    batch.pos[i], batch.n_seq_id[i] = pos + start + i, 1
                    batch.seq_id[i][0], batch.logits[i] = seq, False
                batch.n_tokens = count
                self.session.steer_rows(count)
                rc = lib.llama_decode(ctx, batch)
                if rc != 0:
                    raise LocalinferError(f"llama_decode failed with code {rc} on a medium"
                                          + (" (the context is full)" if rc == 1 else ""))
        finally:
            if not causal:
                lib.llama_set_causal_attn(ctx, True)
            lib.llama_batch_free(batch)
            self.session._row0_view = None

    def _row(self, i: int) -> np.ndarray:
        ptr = engine().llama_get_logits_ith(self.session._ctx, i)   # after the batch's i-th token
        addr = ctypes.cast(ptr, ctypes.c_void_p).value
        row = (ctypes.c_float * self.session.n_vocab).from_address(addr)
        return np.frombuffer(row, dtype=np.float32).copy()

    def forget(self, seq: int) -> None:
        """Free every cell of `seq`: a finished or cancelled request gives its room back at once."""
        engine().llama_memory_seq_rm(self._mem, seq, -1, -1)

    def clear(self) -> None:
        """Free every cell of every sequence."""
        engine().llama_memory_clear(self._mem, True)

    def trim(self, seq: int, n_keep: int) -> None:
        """Keep the first n_keep tokens of `seq`, free the rest."""
        engine().llama_memory_seq_rm(self._mem, seq, n_keep, -1)

    def restore(self, seq: int, state: bytes, n_keep: int) -> bool:
        """Load a saved single-sequence state (the prompt cache's) into `seq`, keeping its first
        n_keep tokens; False, with `seq` empty, when llama.cpp refuses it."""
        lib = engine()
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if lib.llama_state_seq_set_data(self.session._ctx, buf, len(state), seq) != len(state) \
                or not lib.llama_memory_seq_rm(self._mem, seq, n_keep, -1):
            self.forget(seq)
            return False
        return True

    def share(self, src: int, dst: int, n_tokens: int) -> None:
        """`dst` starts with the first n_tokens of `src` (a shared prompt prefix; the unified
        pool shares the cells, nothing is copied)."""
        engine().llama_memory_seq_cp(self._mem, src, dst, 0, n_tokens)

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            engine().llama_batch_free(self._batch)
            self._batch = None
        self.session.close()
