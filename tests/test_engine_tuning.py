"""The `devices` hint for a llama.cpp tuned for an older CPU than this one (backends/llama/tuning.py)."""

import re
import shutil
import subprocess

import pytest

from localinfer.backends.llama import tuning

ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "flags\t\t: fpu sse avx2 avx512f avx512bw\n\nprocessor\t: 1\n")
ZEN3 = ZEN4.replace(" avx512f avx512bw", "")
XEON = ZEN4.replace("AuthenticAMD", "GenuineIntel").replace(": 25", ": 6")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to compile a library with")
def test_the_compiler_is_read_from_a_real_library(tmp_path):
    source = tmp_path / "x.c"
    source.write_text("int answer(void) { return 42; }\n")
    library = tmp_path / "libx.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-s", "-o", str(library), str(source)], check=True)
    full = subprocess.run(["gcc", "-dumpfullversion"], capture_output=True, text=True).stdout
    major, minor = re.match(r"(\d+)\.(\d+)", full).groups()
    assert tuning.gcc_version(library) == (int(major), int(minor))


def test_zen4_is_told_from_zen3_and_intel():
    assert tuning.is_zen4(ZEN4)
    assert not tuning.is_zen4(ZEN3)
    assert not tuning.is_zen4(XEON)
    assert not tuning.is_zen4("")


@pytest.mark.parametrize("compiler, cpuinfo, hinted", [
    (b"GCC: (Debian 12.2.0-14+deb12u1) 12.2.0", ZEN4, True),
    (b"GCC: (GNU) 12.3.0", ZEN4, False),          # knows znver4
    (b"GCC: (Ubuntu 13.2.0-4ubuntu3) 13.2.0", ZEN4, False),
    (b"GCC: (Debian 12.2.0-14+deb12u1) 12.2.0", ZEN3, False),
    (b"GCC: (Debian 12.2.0-14+deb12u1) 12.2.0", XEON, False),
    (b"clang version 16.0.6", ZEN4, False),       # another compiler: nothing known against it
])
def test_the_hint_names_only_a_build_tuned_for_an_older_cpu(tmp_path, compiler, cpuinfo, hinted):
    (tmp_path / "libggml-cpu.so").write_bytes(b"\x7fELF" + b"\0" * 64 + compiler + b"\0")
    said = tuning.hint(tmp_path, cpuinfo)
    assert (said is not None) == hinted
    if hinted:
        assert "GCC 12.2" in said and "docs/engine.md" in said


def test_no_library_no_hint(tmp_path):
    assert tuning.hint(tmp_path, ZEN4) is None
