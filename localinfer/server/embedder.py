"""The served model opened for embeddings, once, when the first embeddings request asks.

llama.cpp computes embeddings in a context of its own (embedding mode, the model's pooling, every
token's output kept), so the generation worker's context cannot give them, and a server that
never embeds should not pay for one: the first /v1/embeddings or /api/embed request opens it, in
a thread (the event loop and the generation worker go on meanwhile), and requests that arrive
during the load wait for that one load.

What it adds to the memory in use: the model loaded a second time — on the CPU both loads map the
same GGUF file, so its pages are shared and only the second load's own buffers count; layers on a
GPU are a second copy there — a KV cache of `ctx` tokens (f16/bf16), and the compute buffer of one
micro-batch of `ctx` tokens (docs/embeddings.md has the figures). Both contexts stay live until
the server stops: a request for either never waits for a load after the first.

It is opened as `localinfer embed` opens it with its default --ctx and --batch, on the variant the
server loaded (never another one the smaller context would fit), so the same texts get the same
vectors through the CLI and the server.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from localinfer.errors import LocalinferError
from localinfer.fit.options import FitOptions, Reporter
from localinfer.models import refs


class Unavailable(Exception):
    """The model could not be opened for embeddings; `status` is the reply's (501: it cannot
    embed at all; 500: the load failed)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Embeddings:
    """What serve needs to open the served model for embeddings, and the embedder once open."""

    named: refs.Named                 # the variant the server loaded (see pinned())
    fit: FitOptions                   # serve's, with ctx 0: `localinfer embed`'s default
    threads: int = 0
    engine_log: bool = False
    backend: str = "auto"
    log: object = print               # one line when the load fails
    _embedder: object | None = field(default=None, init=False, repr=False)
    _failed: Unavailable | None = field(default=None, init=False, repr=False)
    _loading: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    async def get(self):
        """(the pipeline's Embedder, seconds this call spent loading it: 0 once open). A load
        that failed is not tried again (it would fail again, after the same wait): every later
        request gets the same Unavailable."""
        if self._embedder is not None:
            return self._embedder, 0.0
        async with self._loading:
            if self._failed is not None:
                raise self._failed
            if self._embedder is not None:
                return self._embedder, 0.0
            started = time.perf_counter()
            await asyncio.to_thread(self._open)
            if self._failed is not None:
                raise self._failed
            return self._embedder, time.perf_counter() - started

    def _open(self) -> None:
        """In a thread. The embedder is kept here, not in the awaiting coroutine, so that
        close() finds it even when the server stopped while it loaded."""
        from localinfer.errors import UsageError
        from localinfer.pipeline import embed
        try:
            opened = embed.open_embedder(self.named, self.fit, Reporter(), threads=self.threads,
                                         engine_log=self.engine_log, backend=self.backend)
        except LocalinferError as e:
            # a backend or model that cannot embed (MLX, a reranker) is no fault of the request
            self._failed = Unavailable(f"this server cannot embed with {self.named.ref.display}:"
                                       f" {e}", 501 if isinstance(e, UsageError) else 500)
            self.log(f"opening the model for embeddings failed: {e}")
            return
        with self._guard:
            self._embedder = opened

    def close(self) -> None:
        """When the server has stopped: the embedding context freed (after a call under way)."""
        with self._guard:
            embedder, self._embedder = self._embedder, None
        if embedder is not None:
            embedder.close()


def pinned(named: refs.Named, loaded: refs.ModelRef) -> refs.Named:
    """The name that opens the variant the server loaded: a catalogue or Hub name with --quant
    auto would let the embedding context's smaller fit choose a more precise variant, a second
    file (a second download) whose vectors differ from the served model's."""
    if named.chosen or loaded.quant is None:
        return named
    return refs.Named(refs.with_quant(named.text, loaded.quant), loaded)
