"""The backend boundary: a Session protocol and the registry of hardware backends.

Only modules in this package import an inference engine (llama_cpp, mlx, onnxruntime), and they do
so lazily, so `localinfer --help` stays fast and works without any engine installed.
One subpackage per engine (llama, mlx, onnx); vocab holds what the MLX and ONNX sessions share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal, Protocol, Sequence

if TYPE_CHECKING:          # numpy only for the annotations: `localinfer quantize` never needs it
    import numpy as np

from localinfer.errors import UsageError

# When llama.cpp aborts (a failed GGML_ASSERT, an uncaught C++ exception), ggml forks gdb to print a
# backtrace, and gdb writes ~12 KB of it to our stdout, which carries only the answer. ggml skips the
# backtrace when this variable is set, and reads it once as its library loads (ggml.cpp) and again
# at each abort (ggml.c): so it is set here, before any backend module loads an engine library,
# rather than read through settings. The abort's own one-line message still goes to stderr.
os.environ.setdefault("GGML_NO_BACKTRACE", "1")


DEFAULT_MAX_CTX = 4096   # --ctx 0: the model's trained context, capped to keep the KV cache small


def context_length(n_ctx: int, trained: int | None) -> int:
    """The context a session gets: `n_ctx`, or for 0 the trained one up to DEFAULT_MAX_CTX."""
    return n_ctx or min(trained or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX)


@dataclass(frozen=True)
class LoadOptions:
    n_ctx: int = 0                # 0: see context_length
    n_threads: int = 0            # 0: one per physical core
    n_batch: int = 512            # tokens per llama_decode call during prefill
    verbose: bool = False         # let the engine's own log lines through to stderr
    kv_type: str = "f16"          # KV-cache element type: f16, q8_0 or q4_0
    gpu_layers: int = -1          # layers on the GPU (output layer counted): -1 all, 0 none
    cpu_moe: int = 0              # layers whose expert tensors stay in host memory (fit/moe.py)
    long_prompt: bool = False     # the first eval is a long prefill: llama.cpp's 16-bit cache
                                  # takes f16 K for the tiled attention kernel where the
                                  # CPU backend cannot be steered (llama/kv.py)
    n_seq: int = 1                # KV sequences in the context (llama/batched.py: one per request)
    rope_scaling: str = ""        # "yarn" or "linear": n_ctx stretches the trained context (the
                                  # fit refuses one beyond it otherwise); "": the model's own
    mmproj: str = ""              # a projector file loaded beside the model for images and audio
                                  # (llama.cpp: backends/llama/mtmd.py); "": none


class Grammar(Protocol):
    """Which tokens may come next under a grammar (llama.cpp's grammar sampler holds the state)."""

    def allows(self, ids: np.ndarray) -> np.ndarray: ...       # one bool per token id
    def mask(self, logits: np.ndarray) -> np.ndarray: ...      # disallowed tokens set to -inf
    def accept(self, token: int) -> None: ...                  # only a token it allows
    def clone(self) -> Grammar: ...
    def close(self) -> None: ...


class Session(Protocol):
    """One loaded model with one KV-cache sequence."""

    n_vocab: int
    n_ctx: int
    n_past: int                   # tokens now in the KV cache
    bos_token: int | None
    eos_token: int | None
    add_bos: bool                 # whether the model expects BOS at the start of a prompt
    chat_template: str | None
    metadata: dict[str, str]

    def tokenize(self, text: str, *, special: bool) -> list[int]: ...
    def is_eog(self, token: int) -> bool: ...
    def token_text(self, token: int) -> str: ...
    def piece(self, token: int) -> bytes: ...
    def detokenize(self, tokens: Sequence[int]) -> bytes: ...
    def grammar(self, gbnf: str) -> Grammar:
        """A fresh parse state of this GGUF grammar over the model's vocabulary."""
        ...
    def eval(self, tokens: Sequence[int], *, logits: Literal["last", "all"] = "last") -> np.ndarray:
        """Append tokens to the KV cache; return logits of the last position (1-D) or of all (2-D).

        The array may be a view into engine memory, valid only until the next eval.
        """
        ...
    def trim(self, n_keep: int) -> bool:
        """Drop KV entries past n_keep; False when the engine cannot (the caller then resets)."""
        ...
    def reset(self) -> None: ...
    def state(self) -> bytes: ...
    def restore(self, blob: bytes, n_past: int) -> None: ...
    def state_identity(self) -> dict[str, object]:
        """Model file identity, backend and every setting that shapes state(): the prompt-cache key.

        The context's size belongs only where a state cannot be restored into a context of
        another size: `run` sizes each context to its prompt, and the cache should still hit."""
        ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Piece:
    """Tokens of one sequence at positions `pos`...; `logits`: wanted after its last token."""

    seq: int
    tokens: Sequence[int]
    pos: int
    logits: bool = True


class BatchSession(Protocol):
    """One loaded model whose context holds `n_seq` KV sequences decoded together: what `map` and
    `serve` run on (engine/scheduler.py). `session` is the model's vocabulary and template."""

    session: Session
    n_seq: int
    n_ctx: int                    # the cells all sequences share
    n_batch: int                  # most tokens one decode takes

    def decode(self, pieces: Sequence[Piece]) -> list[np.ndarray | None]:
        """One engine call over every piece; the logits after each piece's last token."""
        ...
    def forget(self, seq: int) -> None: ...
    def clear(self) -> None: ...
    def trim(self, seq: int, n_keep: int) -> None: ...
    def restore(self, seq: int, state: bytes, n_keep: int) -> bool: ...
    def share(self, src: int, dst: int, n_tokens: int) -> None: ...
    def close(self) -> None: ...


class Embedder(Protocol):
    """One model loaded for embeddings: one L2-normalised vector per input (pipeline/embed.py)."""

    n_embd: int                   # the vector's length
    n_ctx: int                    # most tokens one decode (and so one input) holds
    n_seq: int                    # most inputs one decode holds
    pooling: str                  # mean, cls or last
    metadata: dict[str, str]

    def tokenize(self, text: str) -> list[int]:
        """An input's tokens with the model's own BOS/EOS rules; control-token text stays text."""
        ...
    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """One float32 row of unit length per input, in input order."""
        ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    name: str
    is_available: Callable[[], bool]
    supports_architecture: Callable[[str], bool]
    load: Callable[[Path, LoadOptions], Session]
    describe: Callable[[], dict]   # facts for `localinfer devices`
    # Why `auto` must not pick this backend on this machine for the model file (None: no model
    # yet), or None where it may, e.g. MLX off Metal, ONNX without an NPU that runs the model.
    auto_blocker: Callable[[Path | None], str | None] = lambda path=None: None
    # Several sequences in one context (n_seq), for map and serve; None: this backend cannot.
    load_batch: Callable[[Path, LoadOptions, int], BatchSession] | None = None
    # The model in embedding mode (n_ctx: the tokens one decode holds; n_seq: the inputs), for
    # embed and the embeddings endpoints; None: this backend cannot.
    load_embed: Callable[[Path, LoadOptions, int], Embedder] | None = None


# Each engine's subpackage is imported only when asked for: engines are optional and slow to load.
def _llama_cpp() -> Backend:
    from localinfer.backends import llama
    return llama.BACKEND


def _mlx() -> Backend:
    from localinfer.backends.mlx import session
    return session.BACKEND


def _onnx() -> Backend:
    from localinfer.backends.onnx import session
    return session.BACKEND


# Registry in order of preference for `auto`, which takes each only where its auto_blocker
# allows: MLX on Apple Silicon with Metal, ONNX Runtime where an NPU runs the model's whole graph.
_REGISTRY: dict[str, Callable[[], Backend]] = {
    "mlx": _mlx,
    "onnx": _onnx,
    "llama.cpp": _llama_cpp,
}

BACKEND_CHOICES = ("auto", *_REGISTRY)


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise UsageError(f"unknown backend '{name}'; choose one of: {', '.join(BACKEND_CHOICES)}")
    return _REGISTRY[name]()


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str


def choose(requested: str, architecture: str | None, available: dict[str, bool],
           supports: Callable[[str, str], bool], not_here: dict[str, str] | None = None) -> Choice:
    """Pick a backend: the requested one, or the first available one that runs the architecture.

    `not_here` names backends `auto` must pass over on this machine, with why (MLX off Metal).
    A pure function of its arguments so selection is testable without any engine installed.
    """
    if requested != "auto":
        if requested not in available:
            raise UsageError(f"unknown backend '{requested}'; choose one of: {', '.join(BACKEND_CHOICES)}")
        if not available[requested]:
            raise UsageError(f"backend '{requested}' is not installed on this machine")
        return Choice(requested, "requested with --backend")
    passed: list[str] = []
    blocked = not_here or {}
    first = next((n for n, ok in available.items() if ok and n not in blocked), None)
    for name, ok in available.items():
        if not ok:
            continue
        if name in blocked:
            passed.append(f"{name}: {blocked[name]}")
        elif architecture is None or supports(name, architecture):
            why = "the preferred backend on this machine" if name == first else \
                "the first available backend that runs this architecture"
            return Choice(name, f"{why} ({'; '.join(passed)})" if passed else why)
        else:
            passed.append(f"{name} cannot run {architecture}")
    raise UsageError("no installed backend can run this model")


def available_backends() -> dict[str, bool]:
    return {name: _safe_available(name) for name in _REGISTRY}


def _safe_available(name: str) -> bool:
    try:
        return get(name).is_available()
    except ImportError:
        return False


def auto_blockers(available: dict[str, bool], path: Path | None = None) -> dict[str, str]:
    """For each installed backend `auto` must pass over on this machine (for this model): why."""
    blocked = {}
    for name, ok in available.items():
        reason = get(name).auto_blocker(path) if ok else None
        if reason:
            blocked[name] = reason
    return blocked


def select(requested: str, architecture: str | None,
           path: Path | None = None) -> tuple[Backend, Choice]:
    available = available_backends()
    choice = choose(requested, architecture, available,
                    lambda name, arch: get(name).supports_architecture(arch),
                    auto_blockers(available, path) if requested == "auto" else None)
    return get(choice.backend), choice


def select_batch(requested: str, architecture: str | None,
                 path: Path | None = None) -> tuple[Backend, Choice]:
    """`select` among the backends that batch several sequences (map, serve): a requested one
    that cannot is refused in one line naming those that can."""
    return _select_able("load_batch", "cannot decode several requests together; map and serve run",
                        requested, architecture, path)


def select_embed(requested: str, architecture: str | None,
                 path: Path | None = None) -> tuple[Backend, Choice]:
    """`select` among the backends that embed (embed, the embeddings endpoints), refusing a
    requested one that cannot as `select_batch` does."""
    return _select_able("load_embed", "computes no embeddings; embed runs", requested, architecture,
                        path)


def _select_able(ability: str, refusal: str, requested: str, architecture: str | None,
                 path: Path | None) -> tuple[Backend, Choice]:
    able = [name for name in _REGISTRY if _safe_available(name) and getattr(get(name), ability)]
    if requested != "auto" and requested in _REGISTRY and requested not in able:
        raise UsageError(f"the {requested} backend {refusal} on "
                         f"{', '.join(able) or 'llama.cpp'} (--backend auto)")
    available = {name: name in able for name in _REGISTRY}
    choice = choose(requested, architecture, available,
                    lambda name, arch: get(name).supports_architecture(arch),
                    auto_blockers(available, path) if requested == "auto" else None)
    return get(choice.backend), choice
