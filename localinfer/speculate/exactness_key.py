"""What decides the exactness probe's verdict, as the key it is remembered under.

The probe (exactness.py) compares logits of batched evals with those of single steps, bit for bit.
They differ exactly when the engine takes a different code path for a batch (another kernel,
tiling or reduction order): which path runs is decided by the compute graph (architecture,
hyper-parameters, tensor names, shapes and ggml types), the KV cache's types, the thread count,
the placement on a GPU, and the engine build with the CPU it runs on. Weight values and the tokens
fed do not choose a path; they only decide which bits come out of it. The same path gives the same
bits for any values (the kernels are deterministic), and a different path changes the rounding of
sums of thousands of terms, which shows in some of the 16 x n_vocab logits compared for any real
weights. So the verdict carries over to every file with the same header facts: a copy with another
chat template, name or tokenizer, or a fine-tune of the same shapes and types.

The header is read with the checked reader's limits (gguf/header.py: bounded counts and text), and
only what llama.cpp itself builds the graph from enters the key; nothing in it is trusted to be
true of the weights, which the key does not need.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata, util
from pathlib import Path

from localinfer import machine
from localinfer.backends import Session
from localinfer.gguf.header import ArrayInfo, TextInfo, read_header
from localinfer.gguf.split import split_count, whole_model

# Each backend's engine: (distribution, import name); its version and libraries enter the key.
_ENGINES = {"llama.cpp": ("llama-cpp-python", "llama_cpp"), "mlx": ("mlx", "mlx"),
            "onnx": ("onnxruntime", "onnxruntime")}
# llama-cpp-python's shared libraries live beside its Python files; a rebuild (another llama.cpp
# commit, other CPU or GPU flags) under the same version number changes their size or time.
_LIB_SUFFIXES = (".so", ".dylib", ".dll")


def verdict_key(session: Session, model_path: Path, backend: str, probe_version: int) -> str:
    """A digest of everything the verdict depends on (see the module docstring)."""
    parts = {
        "probe": probe_version,
        "model": model_identity(model_path),
        "engine": engine_identity(backend),
        "threads": getattr(session, "n_threads", 0),
        "kv": getattr(session, "kv_type", ""),
        # Layers on a GPU run its kernels, which batch differently: a verdict per placement.
        "gpu_layers": getattr(getattr(session, "offload", None), "gpu_layers", 0),
    }
    blob = json.dumps(parts, sort_keys=True, default=repr).encode()
    return hashlib.blake2b(blob, digest_size=20).hexdigest()


def model_identity(path: Path) -> dict:
    """The header facts llama.cpp builds its compute graph from; not names, template, tokenizer."""
    header = read_header(path)
    if split_count(header) > 1:
        header = whole_model(path, header)[0]      # the tensors of every part
    meta = header.metadata
    arch = str(meta.get("general.architecture", ""))
    hparams = {k: _plain(v) for k, v in meta.items() if arch and k.startswith(arch + ".")}
    return {
        "arch": arch,
        "hparams": hparams,
        "quantization_version": _plain(meta.get("general.quantization_version")),
        # Offsets are left out: where a tensor's bytes sit does not change how they are used.
        "tensors": [(t.name, t.type_name, list(t.shape)) for t in header.tensors],
    }


def engine_identity(backend: str) -> dict:
    """The engine build and the CPU it runs on (ggml picks kernels by the CPU's features)."""
    package, module = _ENGINES.get(backend, (backend, backend))
    try:
        version = metadata.version(package)
    except metadata.PackageNotFoundError:
        version = ""
    return {"backend": backend, "version": version, "libraries": _libraries(module, backend),
            "machine": machine.arch(), "cpu": _cpu_flags()}


def _libraries(module: str, backend: str) -> list:
    """(name, size, mtime) of the engine's shared libraries, found without importing it: the
    package's, or for llama.cpp those of the folder LLAMA_CPP_LIB_PATH loads instead."""
    from localinfer import settings
    spec = util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return []
    override = settings.load().engine_lib_dir if backend == "llama.cpp" else None
    files = sorted(Path(override).glob("*")) if override else \
        [f for root in spec.submodule_search_locations for f in sorted(Path(root).rglob("*"))]
    return [_file_identity(lib) for lib in files
            if lib.is_file() and (lib.suffix in _LIB_SUFFIXES or ".so." in lib.name)]


def _cpu_flags() -> list[str]:
    """The CPU's model and feature flags where the system lists them (Linux); elsewhere the
    processor's name. The key's format: changing it would orphan every stored verdict."""
    found = machine.cpuinfo_fields(("model name", "flags", "Features", "CPU part"))
    if found is None:
        return [machine.processor()]
    return [f"{k}: {v}" for k, v in sorted(found.items())]


def _file_identity(path: Path) -> list:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def _plain(value: object) -> object:
    """A metadata value as JSON: long arrays and texts (kept in the file) by their length."""
    if isinstance(value, (ArrayInfo, TextInfo)):
        return repr(value)
    return value
