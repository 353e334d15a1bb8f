"""The GPUs of this machine: what of their memory a budget counts, and, when the engine cannot use
the GPU that is there, the exact command that rebuilds it so that it can.

The devices come from the engine (`backends/llama/devices.py`); these are pure functions of that
list, so every machine in the tests is a described one. `present` is the one place here that looks
at the machine itself: it names the GPU drivers the operating system has loaded.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from localinfer.backends.llama.devices import Device, offload_targets


@dataclass(frozen=True)
class GpuBuild:
    label: str             # what a user calls it
    cmake: str             # llama-cpp-python's CMAKE_ARGS for it (its README, 0.3.x)


# ggml's backend names (the registry's) -> the llama-cpp-python build that has that backend.
BUILDS = {
    "CUDA": GpuBuild("CUDA", "-DGGML_CUDA=on"),
    "MTL": GpuBuild("Metal", "-DGGML_METAL=on"),
    "Vulkan": GpuBuild("Vulkan", "-DGGML_VULKAN=on"),
    "ROCm": GpuBuild("ROCm", "-DGGML_HIP=on"),
}


@dataclass(frozen=True)
class Hardware:
    what: str              # "an NVIDIA GPU"
    evidence: str          # how we know: "/proc/driver/nvidia"
    backend: str           # the ggml backend that drives it (a key of BUILDS)


def memory_of(devices: list[Device], *, apple_silicon: bool) -> tuple[int, int | None]:
    """(free memory of the discrete GPUs llama.cpp offloads to, summed: it splits the layers
    between them by free memory; the memory a GPU shares with the CPU, or None).

    Apple Silicon's Metal GPU and integrated GPUs use the same RAM as the CPU: that memory is
    counted once, as a limit on the whole model, never added to the RAM.
    """
    targets = offload_targets(devices)
    if not targets:
        return 0, None
    if apple_silicon or targets[0].kind == "igpu":
        reported = [d.memory_free for d in targets if d.memory_total]
        return 0, min(reported) if reported else None
    return sum(d.memory_free for d in targets), None


def placement_rule(devices: list[Device], *, apple_silicon: bool) -> str:
    """How `run` places a model on these devices, in a line (`devices` says it)."""
    targets = offload_targets(devices)
    workers = [d.description for d in devices if d.backend == "RPC"]
    if workers:
        return (f"layers over this machine and the workers ({', '.join(workers)}) by the "
                "memory each offers")
    if not targets:
        return "every layer on the CPU"
    names = ", ".join(d.name for d in targets)
    if apple_silicon or targets[0].kind == "igpu":
        return f"every layer on {names} (memory shared with the CPU)"
    return (f"layers on {names} as its free memory holds, the rest on the CPU; a mixture of "
            f"experts keeps the experts of its first layers in RAM instead (--cpu-moe N)")


def present(root: Path = Path("/"), *, apple_silicon: bool = False) -> list[Hardware]:
    """GPUs whose drivers this machine has loaded, whatever the engine was built for."""
    found = []
    if (root / "proc/driver/nvidia").is_dir():
        found.append(Hardware("an NVIDIA GPU", "/proc/driver/nvidia", "CUDA"))
    if (root / "dev/kfd").exists():
        found.append(Hardware("an AMD GPU", "/dev/kfd", "ROCm"))
    if apple_silicon:
        found.append(Hardware("an Apple Silicon GPU", "macOS on arm64", "MTL"))
    return found


def rebuild_command(build: GpuBuild, *, python: str, version: str) -> str:
    """One line that rebuilds llama-cpp-python `version` with `build`'s backend, from source
    (--no-binary, --no-cache-dir: neither a prebuilt CPU wheel nor the one built before)."""
    return (f'CMAKE_ARGS="{build.cmake}" {shlex.quote(python)} -m pip install --force-reinstall '
            f"--no-cache-dir --no-deps --no-binary llama-cpp-python llama-cpp-python=={version}")


def rebuild_hint(hardware: list[Hardware], devices: list[Device], *, python: str,
                 version: str) -> str | None:
    """The line to print when a GPU is there but the engine has no backend for any GPU; None when
    the engine uses a GPU, there is none, or there is no engine to ask."""
    if not hardware or not devices or any(d.is_gpu for d in devices):
        return None
    first = hardware[0]
    build = BUILDS[first.backend]
    return (f"{first.what} is present ({first.evidence}) but this llama.cpp build has no GPU "
            f"backend, so models run on the CPU; rebuild it for {build.label}: "
            f"{rebuild_command(build, python=python, version=version)}")


def rpc_hint(devices: list[Device], *, python: str, version: str) -> str:
    """The line `devices` prints when the engine has no RPC backend: the command that rebuilds it
    with RPC, keeping the GPU backend it has."""
    flags = [BUILDS[b].cmake for b in sorted({d.backend for d in devices}) if b in BUILDS]
    build = GpuBuild("RPC", " ".join([*flags, "-DGGML_RPC=on"]))
    return ("this llama.cpp build has no RPC backend (for --rpc and `localinfer worker`); "
            f"rebuild it: {rebuild_command(build, python=python, version=version)}")


def this_rebuild_hint(devices: list[Device] | None = None, *, rpc: bool = False) -> str | None:
    """`rebuild_hint` for this machine and the engine installed here (its `devices` if known);
    with `rpc`, `rpc_hint`'s line instead."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    from localinfer.backends.llama import devices as llama_devices
    from localinfer.machine import is_apple_silicon
    try:
        installed = version("llama-cpp-python")
    except PackageNotFoundError:
        return None
    found = llama_devices.devices() if devices is None else devices
    if rpc:
        return rpc_hint(found, python=sys.executable, version=installed)
    return rebuild_hint(present(apple_silicon=is_apple_silicon()), found, python=sys.executable,
                        version=installed)
