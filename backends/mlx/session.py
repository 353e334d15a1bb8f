"""MLX backend: GGUF models on Apple's MLX (Metal on Apple Silicon, the CPU build elsewhere).

The network is mlx-lm's own model definition (see models.py), the weights come straight from the
GGUF file (see weights.py), and tokenization is llama.cpp's, loaded vocabulary-only, so token ids
are identical to the llama.cpp backend's. The KV cache keeps every layer at full length, sliding-
window layers included (their window is a mask), so it can be trimmed anywhere and a saved state
can be restored and then trimmed, just like the llama.cpp backend with `swa_full`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from localinfer.backends import Backend, LoadOptions
from localinfer.backends.vocab import BorrowedVocabulary
from localinfer.errors import ContextOverflow, LocalinferError, ModelLoadError, UsageError
from localinfer.gguf.checks import checked_header
from localinfer.machine import is_apple_silicon

MAX_OUTPUTS = 64              # rows of logits computed at once for logits="all"


def _mx():
    import mlx.core as mx  # lazy: keeps `localinfer --help` fast and MLX optional
    return mx


class MlxSession(BorrowedVocabulary):
    """One mlx-lm model and one KV-cache sequence."""

    def __init__(self, path: Path, options: LoadOptions) -> None:
        from localinfer.backends.mlx import models as mlx_models, weights as mlx_weights
        from localinfer.backends.llama.vocab import LlamaVocab

        if options.rope_scaling:        # before the file is read: a usage error
            raise UsageError(f"the MLX backend does not apply RoPE scaling; --rope-scaling "
                             f"{options.rope_scaling} needs --backend llama.cpp")
        header = checked_header(path)     # the values llama.cpp would refuse, refused here too
        arch = str(header.metadata.get("general.architecture", "unknown"))
        if arch not in mlx_models.ARCHITECTURES:
            raise UsageError(unsupported_message(arch))
        if options.kv_type != "f16":
            raise UsageError(f"the MLX backend keeps its KV cache in the compute type; "
                             f"--kv-type {options.kv_type} needs --backend llama.cpp")
        self._path, self._options, self.architecture = path, options, arch
        self._vocab = LlamaVocab(path, verbose=options.verbose)
        self.dtype = compute_dtype(arch)
        try:
            weights, self.conversion = mlx_weights.load(path, header, conversion_dir())
            self.model = mlx_models.build(header, weights, self.dtype)   # the mlx-lm nn.Module
        except (KeyError, ValueError, RuntimeError) as e:   # tensors or shapes MLX cannot map
            self._vocab.close()
            raise ModelLoadError(f"cannot load {path.name} on MLX ({e}); use --backend llama.cpp") from e
        self._layers = self.model.layers
        self._head = self.model["lm_head"] if "lm_head" in self.model else \
            self.model.model.embed_tokens.as_linear
        self._adopt_vocabulary(self._vocab, options.n_ctx)
        self.n_batch = options.n_batch
        self.n_past = 0
        self._cache = self._new_cache()
        self._out = None        # the last logits: kept alive while numpy views them

    # -- evaluation --------------------------------------------------------------------------------
    def eval(self, tokens: Sequence[int], *, logits: Literal["last", "all"] = "last") -> np.ndarray:
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextOverflow(
                f"the context is full ({self.n_ctx} tokens); raise --ctx or shorten the input")
        if not tokens:
            raise LocalinferError("eval needs at least one token")
        self._resync()
        mx = _mx()
        hidden = []
        starts = range(0, len(tokens), self.n_batch)
        for start in starts:
            chunk = mx.array(list(tokens[start:start + self.n_batch]), dtype=mx.int32)[None]
            h = self.model.model(chunk, cache=self._cache)
            self.n_past += chunk.shape[1]
            if logits == "all":
                hidden.append(h[0])
            if start != starts[-1]:
                # Evaluate chunk by chunk: a long prompt must not become one huge lazy graph.
                mx.eval(h, [(c.keys, c.values) for c in self._cache])
        if logits == "last":
            # One evaluation per decode step: the logits pull the KV-cache writes along with them.
            return self._to_numpy(self._head(h[0, -1:])[0])
        return self._all_rows(mx.concatenate(hidden) if len(hidden) > 1 else hidden[0])

    def _all_rows(self, hidden) -> np.ndarray:
        out = np.empty((hidden.shape[0], self.n_vocab), dtype=np.float32)
        for start in range(0, hidden.shape[0], MAX_OUTPUTS):
            rows = self._head(hidden[start:start + MAX_OUTPUTS]).astype(_mx().float32)
            out[start:start + rows.shape[0]] = np.asarray(rows)[:, :self.n_vocab]
        return out

    def _to_numpy(self, row) -> np.ndarray:
        mx = _mx()
        self._out = row.astype(mx.float32)
        mx.eval(self._out)
        return np.asarray(self._out)[:self.n_vocab]     # a view: no copy of the vocabulary row

    # -- KV cache ----------------------------------------------------------------------------------
    def _new_cache(self) -> list:
        from mlx_lm.models.cache import KVCache
        return [KVCache() for _ in self._layers]

    def _resync(self) -> None:
        """Bring the layers' caches back to n_past after an interrupt (Ctrl-C) that landed while
        a model call moved their offsets layer by layer, before n_past counted the new entries.
        A layer behind n_past (a restore cut short) cannot be mended: start again from empty,
        which the engine sees in n_past and re-evaluates."""
        offsets = {c.offset for c in self._cache}
        if offsets == {self.n_past}:
            return
        if min(offsets) < self.n_past:
            self.reset()
            return
        for c in self._cache:
            c.trim(c.offset - self.n_past)

    def trim(self, n_keep: int) -> bool:
        self._resync()
        if n_keep >= self.n_past:
            return True
        for c in self._cache:
            c.trim(c.offset - n_keep)
        self.n_past = n_keep
        return True

    def reset(self) -> None:
        self._cache = self._new_cache()
        self.n_past = 0

    def state(self) -> bytes:
        """The KV entries of every layer as safetensors bytes (keys and values up to n_past)."""
        mx = _mx()
        arrays = {}
        if self.n_past:
            for i, c in enumerate(self._cache):
                arrays[f"{i}.keys"] = c.keys[..., :self.n_past, :]
                arrays[f"{i}.values"] = c.values[..., :self.n_past, :]
        buf = io.BytesIO()
        mx.save_safetensors(buf, arrays, metadata={"n_past": str(self.n_past)})
        return buf.getvalue()

    def restore(self, blob: bytes, n_past: int) -> None:
        self.reset()
        try:
            arrays, meta = _mx().load(io.BytesIO(blob), format="safetensors", return_metadata=True)
        except (RuntimeError, ValueError) as e:
            raise LocalinferError(f"could not restore the KV-cache state: {e}") from e
        if meta.get("n_past") != str(n_past) or not self._fits(arrays, n_past):
            raise LocalinferError("could not restore the KV-cache state: it does not fit this model")
        for i, c in enumerate(self._cache):
            if n_past:
                c.keys, c.values = arrays[f"{i}.keys"], arrays[f"{i}.values"]
                c.offset = n_past
        self.n_past = n_past

    def _fits(self, arrays: dict, n_past: int) -> bool:
        if n_past > self.n_ctx or len(arrays) != (2 * len(self._cache) if n_past else 0):
            return False
        for i, layer in enumerate(self._layers):
            attn = layer.self_attn
            for part in ("keys", "values"):
                a = arrays.get(f"{i}.{part}")
                if a is None or a.dtype != self.dtype or \
                        tuple(a.shape) != (1, attn.n_kv_heads, n_past, a.shape[-1]):
                    return False
        return True

    def state_identity(self) -> dict[str, object]:
        """Everything that shapes the KV state: a saved state is restored only into an equal one
        (not the context's size: the cache grows as it fills, whatever n_ctx bounds it to)."""
        st = self._path.stat()
        return {"backend": "mlx", "engine": _versions(), "model": str(self._path.resolve()),
                "model_size": st.st_size, "model_mtime_ns": st.st_mtime_ns,
                "n_batch": self.n_batch, "dtype": str(self.dtype), "weights": self.conversion,
                "device": str(_mx().default_device()), "kv": "full"}

    def close(self) -> None:
        self._cache = []
        self._close_vocabulary()


def compute_dtype(arch: str):
    """float32 on the CPU build (its matmuls are float32, and it matches llama.cpp's activations);
    on Metal the half type the model family was trained in, as mlx-lm runs it."""
    mx = _mx()
    if not metal_available():
        return mx.float32
    return mx.bfloat16 if arch.startswith("gemma") else mx.float16


def conversion_dir() -> Path:
    from localinfer import settings
    return settings.load().models_dir / ".mlx"


def metal_available() -> bool:
    try:
        return bool(_mx().metal.is_available())
    except (ImportError, AttributeError):
        return False


def unsupported_message(arch: str) -> str:
    from localinfer.backends.mlx import models as mlx_models
    return (f"the MLX backend cannot run the '{arch}' architecture (it runs "
            f"{', '.join(mlx_models.supported())}); use --backend llama.cpp or --backend auto")


def _versions() -> str:
    from importlib.metadata import version
    return f"mlx {version('mlx')}, mlx-lm {version('mlx-lm')}"


def _is_available() -> bool:
    """MLX, mlx-lm and llama.cpp (for tokenization) installed; found without importing mlx-lm,
    whose package import pulls in transformers (seconds) for nothing when another backend runs."""
    from importlib.util import find_spec
    try:
        if not all(find_spec(name) is not None for name in ("mlx", "mlx_lm", "llama_cpp")):
            return False
        # mlx.core looked up where it lies: find_spec("mlx.core") would import mlx itself.
        places = find_spec("mlx").submodule_search_locations or ()
        return any(any(Path(place).glob("core*")) for place in places)
    except (ImportError, ValueError):
        return False


def _supports_architecture(architecture: str) -> bool:
    from localinfer.backends.mlx import models as mlx_models
    return architecture in mlx_models.ARCHITECTURES


def _auto_blocker(path: Path | None = None) -> str | None:
    """`auto` takes MLX only on Apple Silicon with Metal; its CPU build is slower than llama.cpp."""
    if not is_apple_silicon():
        return "picked automatically only on Apple Silicon with Metal; --backend mlx forces it"
    if not metal_available():
        return "Metal is not available to MLX here"
    return None


def _load(path: Path, options: LoadOptions) -> MlxSession:
    return MlxSession(path, options)


def describe() -> dict:
    mx = _mx()
    return {
        "version": _versions(),
        "gpu_offload": metal_available(),
        "metal": metal_available(),
        "device": str(mx.default_device()),
        "apple_silicon": is_apple_silicon(),
        "architectures": sorted(_arch_names()),
    }


def _arch_names() -> list[str]:
    from localinfer.backends.mlx import models as mlx_models
    return list(mlx_models.supported())


BACKEND = Backend(
    name="mlx",
    is_available=_is_available,
    supports_architecture=_supports_architecture,
    load=_load,
    describe=describe,
    auto_blocker=_auto_blocker,
)
