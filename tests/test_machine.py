"""The machine probe (localinfer/machine.py), on described machines: the OS calls are faked, the
probe's own rules run unchanged."""

from __future__ import annotations

import pytest

from localinfer import machine
from localinfer.machine import Host

LINUX_X86 = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) CPU\nflags\t\t: sse3 avx avx2 fma\n" \
            "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) CPU\nflags\t\t: sse3 avx avx2 fma\n"
# A Raspberry Pi: per-CPU `Features`, then the board's `Hardware` and `Model` lines at the end.
LINUX_ARM = "processor\t: 0\nFeatures\t: fp asimd\nCPU part\t: 0xd08\n\n" \
            "Hardware\t: BCM2835\nModel\t\t: Raspberry Pi 4 Model B\n"


def host(*, system="Linux", release="6.1", arch="x86_64", affinity=None, logical=8, physical=4, cpuinfo=None,
         sysctl=None) -> Host:
    """A machine described by what its OS answers; nothing here asks the real one."""
    return Host(system=lambda: system, release=lambda: release, arch=lambda: arch,
                processor=lambda: "", affinity=lambda: affinity, logical=lambda: logical,
                physical=lambda: physical, memory=lambda: (16 << 30, 8 << 30),
                cpuinfo=lambda: cpuinfo, sysctl=lambda key: sysctl)


@pytest.mark.parametrize("system, arch, apple", [
    ("Darwin", "arm64", True),
    ("Darwin", "x86_64", False),        # an Intel Mac: no Metal for MLX, no unified memory
    ("Linux", "arm64", False),
    ("Linux", "aarch64", False),        # an ARM server or a Pi
    ("Windows", "ARM64", False),
])
def test_is_apple_silicon(system, arch, apple):
    assert machine.is_apple_silicon(host(system=system, arch=arch)) is apple


@pytest.mark.parametrize("affinity, logical, physical, usable, cores", [
    (None, 8, 4, 8, 4),                 # no affinity call (macOS, Windows): every CPU
    ({0, 1, 2, 3, 4, 5, 6, 7}, 8, 4, 8, 4),   # hyper-threads: one thread per physical core
    ({0}, 8, 4, 1, 1),                  # taskset -c 0: one, not the machine's four cores
    ({0, 1}, 8, 4, 2, 2),               # a container's cpuset of two
    ({2, 3, 4, 5, 6, 7}, 8, 8, 6, 6),   # no hyper-threads, six of eight allowed
    (set(), 8, 4, 1, 1),                # an empty answer still leaves one
    (None, None, None, 1, 1),           # the OS cannot tell at all
    (None, 8, None, 8, 8),              # physical cores unknown: the logical count
])
def test_cpus_within_the_affinity(affinity, logical, physical, usable, cores):
    described = host(affinity=affinity, logical=logical, physical=physical)
    assert machine.usable_cpus(described) == usable
    assert machine.physical_cores(described) == cores
    assert machine.default_threads(described) == cores
    assert machine.logical_cpus(described) == (logical or 1)    # the load average's scale


@pytest.mark.parametrize("described, name, flags", [
    (host(cpuinfo=LINUX_X86), "Intel(R) Xeon(R) CPU", {"sse3", "avx", "avx2", "fma"}),
    (host(arch="aarch64", cpuinfo=LINUX_ARM), "Raspberry Pi 4 Model B", {"fp", "asimd"}),
    (host(system="Darwin", arch="arm64", sysctl="Apple M2"), "Apple M2", {"asimd"}),
    (host(system="Darwin", arch="x86_64"), "x86_64", set()),   # sysctl failed: the architecture
    (host(system="Windows", arch="AMD64"), "AMD64", set()),
])
def test_cpu_name_and_flags(described, name, flags):
    assert machine.cpu(described) == (name, flags)
    assert machine.cpu_flags(described) == flags


def test_cpuinfo_fields_are_the_first_cpus():
    """The prompt cache's engine identity keys on these; no file, no fields."""
    fields = ("model name", "flags", "Features", "CPU part")
    assert machine.cpuinfo_fields(fields, host(cpuinfo=LINUX_X86)) == {
        "model name": "Intel(R) Xeon(R) CPU", "flags": "sse3 avx avx2 fma"}
    assert machine.cpuinfo_fields(fields, host(cpuinfo=LINUX_ARM)) == {
        "Features": "fp asimd", "CPU part": "0xd08"}
    assert machine.cpuinfo_fields(fields, host()) is None


def test_a_host_names_only_os_calls():
    with pytest.raises(TypeError, match="cpus"):
        Host(cpus=lambda: 4)


def test_report_facts():
    described = host(system="Darwin", release="24.1", arch="arm64")
    assert machine.os_name(described) == "Darwin 24.1"
    assert machine.arch(described) == "arm64"
    assert machine.machine_cores(host(logical=8, physical=None)) == (None, 8)
    assert machine.ram(described) == (16 << 30, 8 << 30)


def test_this_machine_answers():
    """The real calls work here: at least one CPU, and no more threads than this process may use."""
    assert 1 <= machine.default_threads() <= machine.usable_cpus() <= machine.logical_cpus()
    total, available = machine.ram()
    assert 0 < available <= total
