"""Embeddings: texts to one L2-normalised float32 vector each, what `localinfer embed`,
`Model.embed` and the server's embeddings endpoints call.

    embedder = open_embedder(named, fit, report, batch=32)     # or load("smollm2")
    vectors = embed(embedder, ["first text", "second text"])   # list of lists of floats
    embedder.close()

The model is fitted to the memory budget as every command fits it (the variant, the placement),
then loaded in llama.cpp's embedding mode with its own pooling: mean for a generative model that
declares none (backends/llama/embed.py). `ctx` is the longest input in tokens: a longer one is
refused in one line, or cut to it with `truncate`. Vectors are deterministic: the same text gives
the same bits in every run, and nearly the same vector whichever texts share its batch (cosine
≥ 0.998: ggml's CPU kernels differ with the batch's shape; docs/embeddings.md measures it).

For OpenAI's shape: `check_dimensions` refuses a `dimensions` other than the model's, and
`to_base64` is `encoding_format: "base64"` (the vector's little-endian float32 bytes).
"""

from __future__ import annotations

import base64
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from localinfer.errors import UsageError
from localinfer.fit.options import FitOptions, Reporter
from localinfer.models import refs
from localinfer.pipeline import load as loading

if TYPE_CHECKING:
    import numpy as np

    from localinfer.backends import Embedder as BackendEmbedder

DEFAULT_CTX = 512            # the longest input, in tokens, when none is asked for
DEFAULT_BATCH = 32           # inputs one decode holds
MAX_BATCH = 256              # llama.cpp's most sequences in one context
MIN_DECODE = 512             # tokens one decode holds at least: short inputs pack many to one


@dataclass
class Embedder:
    """A model open for embeddings. Safe to share between threads: calls take turns."""

    ref: refs.ModelRef
    path: Path
    backend: str
    engine: BackendEmbedder
    ctx: int                              # the longest input, in tokens
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        return self.ref.display

    @property
    def dimensions(self) -> int:
        return self.engine.n_embd

    @property
    def pooling(self) -> str:
        return self.engine.pooling

    def close(self) -> None:
        with self._lock:
            self.engine.close()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *_) -> None:
        self.close()


def open_embedder(named: refs.Named, fit: FitOptions, report: Reporter = Reporter(), *,
                  batch: int = DEFAULT_BATCH, threads: int = 0, engine_log: bool = False,
                  backend: str = "auto") -> Embedder:
    """The named model fitted (fit.ctx: the longest input, 0 for DEFAULT_CTX) and loaded for
    embeddings of up to `batch` inputs per decode. A backend that cannot embed is refused before
    anything is pulled or loaded."""
    from localinfer import backends
    from localinfer.gguf.header import read_header
    if not 1 <= batch <= MAX_BATCH:
        raise UsageError(f"the batch must be 1 to {MAX_BATCH} inputs, not {batch}")
    loading.check_backend(backend)
    backends.select_embed(backend, None)
    ctx = fit.ctx or DEFAULT_CTX
    decode = max(ctx, MIN_DECODE)
    fitted = loading.fit_model(named, replace(fit, ctx=decode), report, threads=threads,
                               engine_log=engine_log)
    path = refs.locate(fitted.ref, refs.model_store(), offline=fit.offline,
                       progress=report.progress, notify=report.notify,
                       download_bar=report.download_bar)
    architecture = str(read_header(path).metadata.get("general.architecture", "")) or None
    chosen, choice = backends.select_embed(backend, architecture, path)
    engine = chosen.load_embed(path, replace(fitted.options, n_ctx=decode), batch)
    return Embedder(fitted.ref, path, choice.backend, engine, min(ctx, engine.n_ctx))


def load(model: str, *, ctx: int = 0, batch: int = DEFAULT_BATCH, quant: str = "auto",
         backend: str = "auto", threads: int = 0, memory: str | None = None,
         offline: bool = False, notify: Callable[[str], None] | None = None) -> Embedder:
    """`open_embedder` from a model's name, as `localinfer embed MODEL` names it."""
    fit = FitOptions(quant=quant, ctx=ctx, memory=memory, offline=offline)
    report = Reporter(notify=notify) if notify else Reporter()
    loading.check_backend(backend)
    return open_embedder(loading.name(model, fit, report), fit, report, batch=batch,
                         threads=threads, backend=backend)


def input_tokens(embedder: Embedder, text: str, *, truncate: bool = False,
                 label: str = "the input") -> list[int]:
    """One input's tokens, refused in one line naming it (`label`) when it is empty or longer
    than the context (cut to it with `truncate`)."""
    if not isinstance(text, str):
        raise UsageError(f"{label} is not text")
    if not text:
        raise UsageError(f"{label} is empty: there is nothing to embed")
    tokens = embedder.engine.tokenize(text)
    if len(tokens) > embedder.ctx:
        if not truncate:
            raise UsageError(f"{label} holds {len(tokens)} tokens, more than the context "
                             f"({embedder.ctx}); raise the context (--ctx) or truncate "
                             "(--truncate)")
        tokens = tokens[:embedder.ctx]
    if not tokens:
        raise UsageError(f"{label} has no tokens to embed")
    return tokens


def vectors_of(embedder: Embedder, inputs: Sequence[Sequence[int]]) -> np.ndarray:
    """One unit-length float32 row per tokenized input (input_tokens), in order."""
    with embedder._lock:
        return embedder.engine.embed(inputs)


def vectors(embedder: Embedder, texts: str | Sequence[str], *,
            truncate: bool = False) -> np.ndarray:
    """One unit-length float32 row per text (a single string: one row), in order."""
    items = [texts] if isinstance(texts, str) else list(texts)
    single = len(items) == 1
    tokens = [input_tokens(embedder, text, truncate=truncate,
                           label="the input" if single else f"input {i}")
              for i, text in enumerate(items)]
    return vectors_of(embedder, tokens)


def embed(embedder: Embedder, texts: str | Sequence[str], *,
          truncate: bool = False) -> list[list[float]]:
    """One L2-normalised vector per text, as lists of floats (see `vectors`)."""
    return vectors(embedder, texts, truncate=truncate).tolist()


def check_dimensions(dimensions: int | None, embedder: Embedder) -> None:
    """OpenAI's `dimensions`: accepted only as the model's own (no model here is trained to be
    cut shorter, so a shorter vector would be a worse one, silently)."""
    if dimensions is None or dimensions == embedder.dimensions:
        return
    raise UsageError(f"dimensions must be {embedder.dimensions}, the length of "
                     f"{embedder.name}'s vectors, not {dimensions}")


def to_base64(vector) -> str:
    """OpenAI's `encoding_format: "base64"`: the vector's float32 values, little-endian, in
    base64."""
    import numpy as np
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
