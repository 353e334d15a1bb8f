"""Whether the loaded llama.cpp was compiled for this CPU as well as the compiler could.

`pip install` compiles llama.cpp with -march=native, which also tunes for the CPU the compiler
recognises. A GCC older than the CPU tunes for an older one: GCC before 12.3 takes an AMD Zen 4
for a Zen 3 (-mtune=znver3), and on such a machine that build prefills slower than the same
code tuned generically (measured: docs/engine.md). The compiler's name and version stay in each
library's .comment section, which stripping keeps, so the build can be told apart without symbols.
"""

from __future__ import annotations

import re
from pathlib import Path

# The first GCC that knows Zen 4 (-march=znver4): 13.1, and 12.3 by backport.
_ZEN4_GCC = (12, 3)
_GCC = re.compile(rb"GCC: \([^)\n]{0,80}\) (\d+)\.(\d+)")
_READ_LIMIT = 64 << 20     # a library larger than this is not read whole for one line


def gcc_version(library: Path) -> tuple[int, int] | None:
    """(major, minor) of the GCC that compiled `library`, from its .comment section; None for
    another compiler, an unreadable file or one too large to read for this."""
    try:
        if library.stat().st_size > _READ_LIMIT:
            return None
        found = _GCC.search(library.read_bytes())
    except OSError:
        return None
    return (int(found[1]), int(found[2])) if found else None


def is_zen4(cpuinfo: str) -> bool:
    """An AMD CPU of family 25 (0x19: Zen 3 and Zen 4) with AVX-512, which only Zen 4 has."""
    first = cpuinfo.split("\n\n", 1)[0]
    fields = dict((k.strip(), v.strip()) for k, _, v in
                  (line.partition(":") for line in first.splitlines()) if k.strip())
    return (fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25"
            and "avx512f" in fields.get("flags", "").split())


def hint(folder: Path, cpuinfo: str | None = None) -> str | None:
    """One sentence when the libraries in `folder` were tuned for an older CPU than this one;
    None when nothing is known against them."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    if not is_zen4(cpuinfo):
        return None
    cpu_lib = next(iter(sorted(folder.glob("libggml-cpu*.so*"))), None)
    version = gcc_version(cpu_lib) if cpu_lib else None
    if version is None or version >= _ZEN4_GCC:
        return None
    return (f"llama.cpp was compiled by GCC {version[0]}.{version[1]}, which tunes this Zen 4 "
            "CPU as a Zen 3: a build with -mtune=generic prefills faster here (docs/engine.md)")
