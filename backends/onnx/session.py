"""ONNX Runtime backend: the GGUF files users already have, exported to ONNX and run on an
execution provider (the CPU here; NPU providers through the static graph form).

The export (export.py) is made once per model file and cached in the store. Tokenization is
llama.cpp's, loaded vocabulary-only, so token ids match the other backends. The KV cache keeps
every position of every layer (sliding-window layers mask, they do not drop), so it can be trimmed
anywhere and a saved state restored and then trimmed, like the llama.cpp backend with `swa_full`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from localinfer.backends import Backend, LoadOptions
from localinfer.backends.onnx.devices import CPU, Target
from localinfer.backends.vocab import BorrowedVocabulary
from localinfer.errors import ContextOverflow, LocalinferError, ModelLoadError, UsageError

# Providers that run the dynamic graph (GroupQueryAttention, any number of tokens per call); any
# other provider gets the static plain-op graphs.
DYNAMIC_PROVIDERS = {"CPUExecutionProvider", "DmlExecutionProvider", "WebGpuExecutionProvider"}
MAX_LOGIT_BYTES = 256 << 20    # logits="all": rows per call so one call's output stays below this
_STATE = struct.Struct("<8sIIIII")
_STATE_MAGIC = b"LIONNXKV"


@dataclass(frozen=True)
class OnnxOptions:
    """How the export runs; the defaults are `--backend onnx`'s."""

    accuracy: int = 4              # MatMulNBits accuracy_level: 0 exact float32, 4 int8 activations
    target: Target = CPU           # the provider and device (devices.py)
    form: str = "auto"             # "dynamic", "static", or by provider
    prefill_tokens: int = 64       # static form: tokens per prefill call
    session_config: tuple[tuple[str, str], ...] = ()   # ORT session config entries


class OnnxSession(BorrowedVocabulary):
    """One exported model on ONNX Runtime and one KV-cache sequence."""

    def __init__(self, path: Path, options: LoadOptions, onnx: OnnxOptions = OnnxOptions()) -> None:
        from localinfer.backends.onnx import arch as onnx_arch
        from localinfer.backends.llama.vocab import LlamaVocab
        from localinfer.gguf.checks import checked_header

        if options.rope_scaling:
            raise UsageError(f"the ONNX backend does not apply RoPE scaling; --rope-scaling "
                             f"{options.rope_scaling} needs --backend llama.cpp")
        if options.kv_type != "f16":
            raise UsageError(f"the ONNX backend keeps its KV cache in float32; "
                             f"--kv-type {options.kv_type} needs --backend llama.cpp")
        if onnx.accuracy not in (0, 1, 2, 3, 4):
            raise UsageError(f"accuracy level {onnx.accuracy} is not one of 0-4")
        header = checked_header(path)
        self.spec = onnx_arch.read_spec(path, header)
        self._path, self._options, self._onnx = path, options, onnx
        self._vocab = LlamaVocab(path, verbose=options.verbose)
        if self._vocab.n_vocab != self.spec.n_vocab:
            self._vocab.close()
            raise ModelLoadError(f"cannot load {path.name}: {self._vocab.n_vocab} tokens but "
                                 f"{self.spec.n_vocab} embedding rows")
        self.architecture = self.spec.arch
        self._adopt_vocabulary(self._vocab, options.n_ctx)
        self.n_batch = max(1, options.n_batch)
        self.n_past = 0
        self._max_rows = max(1, MAX_LOGIT_BYTES // (4 * self.n_vocab))
        try:
            self._runner, self.form, self.export_key = _open(path, header, self.spec, self.n_ctx,
                                                             options, onnx)
        except BaseException:
            self._vocab.close()
            raise

    # -- evaluation --------------------------------------------------------------------------------
    def eval(self, tokens: Sequence[int], *, logits: Literal["last", "all"] = "last") -> np.ndarray:
        n = len(tokens)
        if not n:
            raise LocalinferError("eval needs at least one token")
        if self.n_past + n > self.n_ctx:
            raise ContextOverflow(
                f"the context is full ({self.n_ctx} tokens); raise --ctx or shorten the input")
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.n_vocab:
            raise LocalinferError(f"token id {int(ids.max() if ids.max() >= self.n_vocab else ids.min())} "
                                  f"is outside the vocabulary of {self.n_vocab}")
        step = self.n_batch if logits == "last" else min(self.n_batch, self._max_rows)
        rows = []
        for start in range(0, n, step):
            chunk = ids[start:start + step]
            out = self._runner.run(chunk, self.n_past, len(chunk) - 1 if logits == "last" else 0)
            self.n_past += len(chunk)
            if logits == "all":
                rows.append(out if start + step >= n else out.copy())
        if logits == "last":
            return out[-1]
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    # -- KV cache ----------------------------------------------------------------------------------
    def trim(self, n_keep: int) -> bool:
        # Rows past n_past are never read (GroupQueryAttention reads up to seqlens_k, the static
        # graphs mask them), so dropping them is forgetting them.
        self.n_past = max(0, min(n_keep, self.n_past))
        return True

    def reset(self) -> None:
        self.n_past = 0

    def state(self) -> bytes:
        """Every layer's K and V rows up to n_past, after a header that says whose they are."""
        spec, n = self.spec, self.n_past
        head = _STATE.pack(_STATE_MAGIC, 1, len(self._runner.buffers), spec.n_kv, spec.head_dim, n)
        return head + b"".join(buf[:, :, :n].tobytes() for buf in self._runner.buffers)

    def restore(self, blob: bytes, n_past: int) -> None:
        self.reset()
        buffers, spec = self._runner.buffers, self.spec
        row_bytes = spec.n_kv * spec.head_dim * 4
        expected = (_STATE_MAGIC, 1, len(buffers), spec.n_kv, spec.head_dim, n_past)
        if len(blob) < _STATE.size or _STATE.unpack_from(blob) != expected \
                or not 0 <= n_past <= self.n_ctx \
                or len(blob) != _STATE.size + len(buffers) * n_past * row_bytes:
            raise LocalinferError("could not restore the KV-cache state: it does not fit this model")
        shape = (1, spec.n_kv, n_past, spec.head_dim)
        for i, buf in enumerate(buffers):
            start = _STATE.size + i * n_past * row_bytes
            buf[:, :, :n_past] = np.frombuffer(blob, np.float32, n_past * row_bytes // 4,
                                               start).reshape(shape)
        self.n_past = n_past

    def state_identity(self) -> dict[str, object]:
        """Everything that shapes the KV state: a saved state is restored only into an equal one."""
        st = self._path.stat()
        return {"backend": "onnx", "engine": _versions(), "model": str(self._path.resolve()),
                "model_size": st.st_size, "model_mtime_ns": st.st_mtime_ns, "n_ctx": self.n_ctx,
                "n_batch": self.n_batch, "export": self.export_key, "form": self.form,
                "target": self._onnx.target.key, "kv": "float32"}

    def close(self) -> None:
        self._runner = None
        self._close_vocabulary()


# -- opening the export on ONNX Runtime -------------------------------------------------------------
def _open(path: Path, header, spec, n_ctx: int, options: LoadOptions, onnx: OnnxOptions):
    """(runner, form file name, export key); an export ONNX Runtime refuses is rebuilt once."""
    from localinfer.backends.onnx import export as onnx_export
    for attempt in (1, 2):
        folder, index = onnx_export.ensure_weights(path, header, spec, onnx_export.export_root())
        try:
            runner, form = _runner(folder, index, spec, n_ctx, options, onnx)
            return runner, form, index.key
        except (ModelLoadError, UsageError):
            raise
        except Exception as e:       # ORT's own errors on a damaged graph or weights file
            if attempt == 2:
                reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                raise ModelLoadError(f"ONNX Runtime cannot load the export of {path.name}: "
                                     f"{reason}") from e
            onnx_export.discard(folder)
    raise AssertionError("unreachable")


def _runner(folder: Path, index, spec, n_ctx: int, options: LoadOptions, onnx: OnnxOptions):
    from localinfer.backends.onnx import runner as onnx_runner
    from localinfer.backends.onnx.export import Form, ensure_graph
    factors = index.vector(folder, "rope_freqs.weight") if spec.rope_factors else None
    tables = onnx_runner.rope_tables(spec, n_ctx, factors)
    kind = graph_form(onnx)
    if kind == "dynamic":
        form = Form("dynamic", onnx.accuracy)
        session = _session(ensure_graph(folder, index, spec, form), options, onnx)
        return onnx_runner.DynamicRunner(session, spec, n_ctx, tables), form.file_name
    prefill = Form("static", onnx.accuracy, min(onnx.prefill_tokens, n_ctx), n_ctx)
    decode = Form("static", onnx.accuracy, 1, n_ctx)
    sessions = [_session(ensure_graph(folder, index, spec, f), options, onnx)
                for f in (prefill, decode)]
    return onnx_runner.StaticRunner(*sessions, spec, prefill.tokens, n_ctx, tables), \
        prefill.file_name


def _session(graph: Path, options: LoadOptions, onnx: OnnxOptions):
    from localinfer.backends.onnx.devices import open_session
    from localinfer.machine import default_threads
    return open_session(graph, onnx.target, options.n_threads or default_threads(),
                        config=dict(onnx.session_config))


def graph_form(onnx: OnnxOptions) -> str:
    if onnx.form != "auto":
        return onnx.form
    return "dynamic" if onnx.target.provider in DYNAMIC_PROVIDERS else "static"


def _versions() -> str:
    import onnx
    import onnxruntime      # its own version: an NPU build (openvino, qnn) has another package name
    return f"onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}"


# -- the registry's record --------------------------------------------------------------------------
def _is_available() -> bool:
    """onnxruntime, onnx and gguf for the export, llama.cpp for tokenization; found without
    importing them (onnxruntime's import takes a few hundred milliseconds)."""
    from importlib.util import find_spec
    try:
        return all(find_spec(n) is not None for n in ("onnxruntime", "onnx", "gguf", "llama_cpp"))
    except (ImportError, ValueError):
        return False


def _supports_architecture(architecture: str) -> bool:
    from localinfer.backends.onnx.arch import ARCHITECTURES
    return architecture in ARCHITECTURES


def _auto_blocker(path: Path | None = None) -> str | None:
    """`auto` takes ONNX only where an NPU runs the model's whole graph (npu.py); on a CPU
    llama.cpp keeps the model: its KV-cache types, GPU layers and memory fit are not here."""
    from localinfer.backends.onnx import npu as onnx_npu
    decision = onnx_npu.decide(path)
    if decision.target is not None:
        return None
    return f"picked automatically only for an NPU that runs the whole graph: {decision.reason}; " \
           "--backend onnx forces the CPU provider"


def _providers() -> list[str]:
    try:
        import onnxruntime
    except ImportError:
        return []
    return list(onnxruntime.get_available_providers())


def _load(path: Path, options: LoadOptions) -> OnnxSession:
    """On the NPU that runs the whole graph, where there is one; else on the CPU provider."""
    from localinfer.backends.onnx import npu as onnx_npu
    target = onnx_npu.decide(path, options.n_threads).target
    return OnnxSession(path, options, OnnxOptions(target=target or CPU))


def describe() -> dict:
    from localinfer.backends.onnx import devices as onnx_devices
    from localinfer.backends.onnx.arch import ARCHITECTURES
    return {"version": _versions(), "gpu_offload": False, "providers": _providers(),
            "plugins": onnx_devices.register_plugins(),
            "devices": [{"provider": t.provider, "type": t.kind, "vendor": t.vendor,
                         "auto": _device_reason(t)} for t in onnx_devices.targets()],
            "architectures": sorted(ARCHITECTURES),
            "auto": _auto_blocker() or "auto may pick it on this machine"}


def _device_reason(target: Target) -> str:
    """Why `auto` would or would not run a model on this device."""
    if target.kind == "NPU":
        return "used for a model whose whole graph it runs (checked on the model's first run " \
               "and remembered)"
    if target.kind == "GPU":
        return "not used: llama.cpp's GPU layers run models on GPUs"
    return "not used by auto: llama.cpp runs models on the CPU (KV-cache types, memory fit); " \
           "--backend onnx runs here"


BACKEND = Backend(
    name="onnx",
    is_available=_is_available,
    supports_architecture=_supports_architecture,
    load=_load,
    describe=describe,
    auto_blocker=_auto_blocker,
)
