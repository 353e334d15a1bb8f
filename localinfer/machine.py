"""The one probe of this machine: what it is (Apple Silicon or not, its CPU's name and features)
and how many CPUs this process may use. Everything else asks here instead of asking the OS.

It sits in the lowest layer because the backends need it (llama.cpp's and ONNX Runtime's thread
counts, MLX's and Metal's Apple-Silicon test) and they sit below `fit`, whose `machine.detect`
turns these answers into the `devices` report.

The OS calls go through one `Host` record, so that tests describe a machine (a container limited
to some CPUs, a Mac) by handing in fake calls instead of patching the OS.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path


def _affinity() -> set[int] | None:
    """The CPUs this process may run on, where the system tells (Linux); None elsewhere."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def _physical() -> int | None:
    import psutil       # imported on first use: `localinfer --help` never counts cores
    return psutil.cpu_count(logical=False)


def _memory() -> tuple[int, int]:
    import psutil
    memory = psutil.virtual_memory()
    return memory.total, memory.available


def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:     # not Linux
        return None


def _sysctl(key: str) -> str | None:
    import subprocess   # macOS only: not loaded where it is never asked
    try:
        return subprocess.run(["sysctl", "-n", key], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


class Host:
    """The OS calls the probe makes; the defaults ask this machine, a test names its fakes:
    `Host(affinity=lambda: {0})`. (A plain class: a dataclass or NamedTuple of these fields costs
    `localinfer --help`, which imports this module, 2 ms to build.)"""

    system: Callable[[], str] = staticmethod(platform.system)     # "Linux", "Darwin", "Windows"
    release: Callable[[], str] = staticmethod(platform.release)
    arch: Callable[[], str] = staticmethod(platform.machine)       # "x86_64", "arm64", "aarch64"
    processor: Callable[[], str] = staticmethod(platform.processor)
    affinity: Callable[[], set[int] | None] = staticmethod(_affinity)
    logical: Callable[[], int | None] = staticmethod(os.cpu_count)  # every CPU of the machine
    physical: Callable[[], int | None] = staticmethod(_physical)    # None where it cannot be told
    memory: Callable[[], tuple[int, int]] = staticmethod(_memory)   # RAM (total, available), bytes
    cpuinfo: Callable[[], str | None] = staticmethod(_cpuinfo)      # /proc/cpuinfo's text (Linux)
    sysctl: Callable[[str], str | None] = staticmethod(_sysctl)     # macOS's hardware facts

    def __init__(self, **calls: Callable) -> None:
        for name, call in calls.items():
            if not hasattr(Host, name):
                raise TypeError(f"Host has no OS call named {name!r}")
            setattr(self, name, call)


HOST = Host()


def is_apple_silicon(host: Host = HOST) -> bool:
    """macOS on an Apple CPU: where Metal and MLX run."""
    return host.system() == "Darwin" and host.arch() == "arm64"


def os_name(host: Host = HOST) -> str:
    return f"{host.system()} {host.release()}"


def arch(host: Host = HOST) -> str:
    return host.arch()


def logical_cpus(host: Host = HOST) -> int:
    """Every logical CPU of the machine (the scale of its load average), affinity or not."""
    return host.logical() or 1


def usable_cpus(host: Host = HOST) -> int:
    """The CPUs this process may run on: its affinity mask where the system has one (taskset, a
    container's cpuset), else every CPU. More compute threads than these spin-wait for a CPU."""
    allowed = host.affinity()
    if allowed is None:
        return logical_cpus(host)
    return len(allowed) or 1


def ram(host: Host = HOST) -> tuple[int, int]:
    """RAM in bytes: (total, available now)."""
    return host.memory()


def machine_cores(host: Host = HOST) -> tuple[int | None, int | None]:
    """(physical, logical) cores of the whole machine, as the OS counts them (None: unknown)."""
    return host.physical(), host.logical()


def physical_cores(host: Host = HOST) -> int:
    """Physical cores, but no more than the CPUs this process may use."""
    cores = host.physical() or host.logical() or 1
    allowed = host.affinity()
    return max(1, min(cores, len(allowed) if allowed is not None else cores))


def default_threads(host: Host = HOST) -> int:
    """Compute threads for `--threads 0`: one per physical core (as llama-bench: hyper-threads slow
    matrix work down), within the CPUs this process may use."""
    return physical_cores(host)


def cpu(host: Host = HOST) -> tuple[str, set[str]]:
    """The CPU's name and its feature flags as /proc/cpuinfo names them (empty where unknown)."""
    text = host.cpuinfo()
    if text is not None:
        return _parse_cpuinfo(text, host.processor() or host.arch())
    if host.system() == "Darwin":
        return host.sysctl("machdep.cpu.brand_string") or host.arch(), \
            {"asimd"} if host.arch() == "arm64" else set()
    return host.processor() or host.arch(), set()


def cpu_flags(host: Host = HOST) -> set[str]:
    return cpu(host)[1]


def _parse_cpuinfo(text: str, name: str) -> tuple[str, set[str]]:
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "Hardware") and value.strip():
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())      # the first CPU's: all of them are alike
    return name, flags


def cpuinfo_fields(wanted: tuple[str, ...], host: Host = HOST) -> dict[str, str] | None:
    """The first CPU's value of each wanted /proc/cpuinfo field; None where there is no such file."""
    text = host.cpuinfo()
    if text is None:
        return None
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            found.setdefault(key.strip(), value.strip())
    return found


def processor(host: Host = HOST) -> str:
    return host.processor()
