"""ONNX Runtime's devices, and whether an NPU runs a model's whole graph.

Plugin providers are registered first: a vendor package that names its library (onnxruntime-qnn's
`get_ep_name()` / `get_library_path()`), or a library a vendor installer put on disk, named in
LOCALINFER_ORT_EP_LIBRARIES as `NAME=PATH` entries separated by the path separator. Then
`get_ep_devices()` lists every (provider, device) pair, each device typed CPU, GPU or NPU. The
OpenVINO and VitisAI providers are built into their own onnxruntime builds (which replace the
onnxruntime package) and may not list a device; they are tried with the options that put them on
the NPU.

An NPU takes a model only if ONNX Runtime, with CPU fallback disabled, places every node of the
static graphs there. That check compiles the graphs, so its verdict is remembered in the export
folder (`npu.json`), keyed by the provider, the device and the onnxruntime version, and the
compiled graph the provider writes (`ep.context_enable`) is kept next to the graph it came from.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

PLUGIN_MODULES = ("onnxruntime_qnn",)           # packages with get_ep_name() and get_library_path()
LIBRARIES_ENV = "LOCALINFER_ORT_EP_LIBRARIES"
# Providers of their own onnxruntime build, and the options that put them on the NPU.
BUILT_IN_NPU = {"OpenVINOExecutionProvider": {"device_type": "NPU"},
                "VitisAIExecutionProvider": {},
                "QNNExecutionProvider": {"backend_type": "htp"}}
VERDICTS = "npu.json"
_registered: dict[str, str | None] = {}        # name -> None, or why it could not be registered


@dataclass(frozen=True)
class Target:
    """One provider on one device: what a session is created for."""

    provider: str
    kind: str                     # "NPU", "GPU" or "CPU", as ONNX Runtime types the device
    vendor: str = ""
    device_id: int = 0
    options: tuple[tuple[str, str], ...] = ()
    ep_device: object = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> str:
        return f"{self.provider}/{self.kind}/{self.vendor or '?'}/{self.device_id:#x}"

    @property
    def label(self) -> str:
        where = f"{self.vendor} {self.kind}".strip() if self.vendor else self.kind
        return f"{self.provider} on the {where}"

    def add_to(self, so) -> list | None:
        """Put this target on session options; the `providers` argument InferenceSession takes."""
        if self.ep_device is not None:
            so.add_provider_for_devices([self.ep_device], dict(self.options))
            return None
        return [(self.provider, dict(self.options))]


CPU = Target("CPUExecutionProvider", "CPU")


@dataclass(frozen=True)
class Verdict:
    whole: bool
    detail: str                   # ORT's own words, or which ops stayed off the device


# -- finding devices --------------------------------------------------------------------------------
def register_plugins() -> dict[str, str | None]:
    """Register every plugin provider library found, once per process: name -> None or a reason."""
    import onnxruntime as ort
    for name, path in _plugin_libraries().items():
        if name in _registered:
            continue
        try:
            ort.register_execution_provider_library(name, path)
            _registered[name] = None
        except Exception as e:          # a library for another OS or onnxruntime version
            _registered[name] = _first_line(e)
    return dict(_registered)


def _plugin_libraries() -> dict[str, str]:
    import importlib
    found: dict[str, str] = {}
    for module in PLUGIN_MODULES:
        try:
            plugin = importlib.import_module(module)
            found[plugin.get_ep_name()] = str(plugin.get_library_path())
        except Exception:               # not installed, or a build without the helpers
            continue
    for entry in filter(None, os.environ.get(LIBRARIES_ENV, "").split(os.pathsep)):
        name, sep, path = entry.partition("=")
        if sep and name.strip() and path.strip():
            found[name.strip()] = path.strip()
    return found


def targets() -> list[Target]:
    """Every device ONNX Runtime can use here, plugins registered first."""
    import onnxruntime as ort
    register_plugins()
    found = [_target(d) for d in ort.get_ep_devices()]
    listed = {t.provider for t in found}
    for provider, options in BUILT_IN_NPU.items():
        if provider in ort.get_available_providers() and provider not in listed:
            found.append(Target(provider, "NPU", options=tuple(options.items())))
    return found


def _target(device) -> Target:
    hardware = device.device
    return Target(device.ep_name, hardware.type.name, hardware.vendor or device.ep_vendor,
                  int(hardware.device_id), ep_device=device)


def npu_targets(found: list[Target] | None = None) -> list[Target]:
    return [t for t in (targets() if found is None else found) if t.kind == "NPU"]


# -- the whole-graph check ---------------------------------------------------------------------------
def check(target: Target, graphs: list[Path], threads: int) -> Verdict:
    """Create each graph's session on `target` with CPU fallback disabled; a refusal, or any node
    placed elsewhere, means the NPU cannot take the model."""
    for graph in graphs:
        try:
            session = open_session(graph, target, threads, strict=True)
        except Exception as e:
            return Verdict(False, f"{graph.name}: {_first_line(e)}{_fallen_back(graph, target, threads)}")
        off = _off_target(session, target)
        if off:
            return Verdict(False, f"{graph.name}: {off}")
    return Verdict(True, f"every node of {', '.join(g.name for g in graphs)} on {target.label}")


def open_session(graph: Path, target: Target, threads: int, *, strict: bool = False,
                 config: dict[str, str] | None = None):
    """A session for `graph` on `target`. Off the CPU, where nodes went is recorded and the
    compiled form is saved on first use and loaded after (the providers that compile write it)."""
    import onnxruntime as ort

    from localinfer.backends.onnx.runner import session_options
    entries, source = dict(config or {}), graph
    if target.kind != "CPU":
        compiled = compiled_path(graph, target)
        source = compiled if compiled.is_file() else graph
        # ORT refuses fallback disabled together with the CPU provider itself.
        entries |= {"session.record_ep_graph_assignment_info": "1",
                    "session.disable_cpu_ep_fallback": "1" if strict else "0"}
        if source == graph:
            entries |= {"ep.context_enable": "1", "ep.context_file_path": str(compiled)}
    so = session_options(threads, entries)
    if strict:
        so.log_severity_level = 4       # a refusal is the answer, not an error to print
    providers = target.add_to(so)
    with warnings.catch_warnings():     # "provider not in this build": the check's answer too
        warnings.simplefilter("ignore")
        return ort.InferenceSession(str(source), so, providers=providers)


def compiled_path(graph: Path, target: Target) -> Path:
    return graph.with_name(f"{graph.stem}.{target.provider}.ctx.onnx")


def _off_target(session, target: Target) -> str:
    """'' when every node runs on the target, else how many did not and their op types."""
    placed = [(sub.ep_name, node.op_type) for sub in session.get_provider_graph_assignment_info()
              for node in sub.get_nodes()]
    off = [op for ep, op in placed if ep != target.provider]
    if not off:
        return ""
    return f"{len(off)} of {len(placed)} nodes not on {target.provider} " \
           f"({', '.join(sorted(set(off))[:8])})"


def _fallen_back(graph: Path, target: Target, threads: int) -> str:
    """After a refusal, which ops the target left to the CPU: a second session with fallback on."""
    try:
        off = _off_target(open_session(graph, target, threads, strict=False), target)
    except Exception:
        return ""
    return f"; {off}" if off else ""


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


# -- remembered verdicts ------------------------------------------------------------------------------
def remembered(folder: Path, target: Target, export_key: str) -> Verdict | None:
    entry = _read(folder).get(_verdict_key(target, export_key))
    if not isinstance(entry, dict) or not isinstance(entry.get("whole"), bool):
        return None
    return Verdict(entry["whole"], str(entry.get("detail", "")))


def remember(folder: Path, target: Target, export_key: str, verdict: Verdict) -> None:
    verdicts = _read(folder)
    verdicts[_verdict_key(target, export_key)] = {"whole": verdict.whole, "detail": verdict.detail}
    tmp = folder / f".{VERDICTS}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.write_text(json.dumps(verdicts, indent=1))
        os.replace(tmp, folder / VERDICTS)
    except OSError:                     # a read-only store: the check runs again next time
        tmp.unlink(missing_ok=True)


def _verdict_key(target: Target, export_key: str) -> str:
    import onnxruntime as ort           # its version, whichever build (qnn, openvino) provides it
    return f"{export_key}|{target.key}|onnxruntime {ort.__version__}"


def _read(folder: Path) -> dict:
    try:
        data = json.loads((folder / VERDICTS).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
