"""Which NPU, if any, takes a model: the decision `auto` and `--backend onnx` act on.

An NPU is used only when it runs every node of the model's static graphs (onnx_devices.check);
the first run of a model on a machine with an NPU exports it and compiles the graphs to find out,
later runs read the remembered verdict. Without an NPU build of onnxruntime installed nothing here
imports onnxruntime, so `run --backend auto` on an ordinary machine pays nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The onnxruntime builds and plugin packages that carry an NPU's execution provider.
NPU_DISTRIBUTIONS = ("onnxruntime-qnn", "onnxruntime-openvino", "onnxruntime-vitisai",
                     "onnxruntime-winml")
CHECK_TOKENS = 64           # the static prefill graph the check compiles, beside the 1-token one
CHECK_SLOTS = 512           # cache rows of the checked graphs: coverage does not depend on it


@dataclass(frozen=True)
class Decision:
    target: object | None   # the onnx_devices.Target to run on, None: no NPU takes this model
    reason: str


_decided: dict[tuple, Decision] = {}    # per process: auto's question and the load ask it twice


def npu_installed() -> list[str]:
    """The NPU builds found by package name, plus plugin libraries named in the environment."""
    import os
    from importlib.metadata import PackageNotFoundError, version

    from localinfer.backends.onnx.devices import LIBRARIES_ENV
    found = []
    for name in NPU_DISTRIBUTIONS:
        try:
            version(name)
        except PackageNotFoundError:
            continue
        found.append(name)
    if os.environ.get(LIBRARIES_ENV, "").strip():
        found.append(LIBRARIES_ENV)
    return found


def decide(path: Path | None, threads: int = 0) -> Decision:
    """The NPU that runs `path`'s whole graph, or why none does (path None: no model yet)."""
    if not npu_installed():
        return Decision(None, "no NPU build of onnxruntime is installed "
                              f"({', '.join(NPU_DISTRIBUTIONS)})")
    from localinfer.backends.onnx import devices as onnx_devices
    npus = onnx_devices.npu_targets()
    if not npus:
        return Decision(None, "onnxruntime here lists no NPU device")
    if path is None:
        return Decision(None, f"{', '.join(t.label for t in npus)} found; a model runs there "
                              "when its whole graph does (checked on its first run)")
    from localinfer.errors import LocalinferError
    key = (str(path.resolve()), path.stat().st_mtime_ns)
    if key not in _decided:
        try:
            _decided[key] = _check_model(path, npus, threads)
        except LocalinferError as e:    # an architecture the exporter lacks, a damaged file
            _decided[key] = Decision(None, f"the ONNX export cannot be made: {e}")
    return _decided[key]


def _check_model(path: Path, npus: list, threads: int) -> Decision:
    from localinfer.backends.onnx import devices as onnx_devices
    folder, key, graphs = _check_graphs(path)
    refusals = []
    for target in npus:
        verdict = onnx_devices.remembered(folder, target, key)
        if verdict is None:
            verdict = onnx_devices.check(target, graphs, threads or _threads())
            onnx_devices.remember(folder, target, key, verdict)
        if verdict.whole:
            return Decision(target, f"{target.label} runs the whole graph")
        refusals.append(f"{target.label} does not run the whole graph ({verdict.detail})")
    return Decision(None, "; ".join(refusals))


def _check_graphs(path: Path) -> tuple[Path, str, list[Path]]:
    """The model's export folder, its key, and the two static graphs the check compiles."""
    from localinfer.backends.onnx import arch as onnx_arch, export as onnx_export
    from localinfer.gguf.checks import checked_header
    header = checked_header(path)
    spec = onnx_arch.read_spec(path, header)
    folder, index = onnx_export.ensure_weights(path, header, spec, onnx_export.export_root())
    forms = [onnx_export.Form("static", 4, CHECK_TOKENS, CHECK_SLOTS),
             onnx_export.Form("static", 4, 1, CHECK_SLOTS)]
    return folder, index.key, [onnx_export.ensure_graph(folder, index, spec, f) for f in forms]


def _threads() -> int:
    from localinfer.machine import default_threads
    return default_threads()
