"""A prompt-cache entry is keyed on the llama.cpp build actually loaded, not on llama-cpp-python's
version: a library swapped in with LLAMA_CPP_LIB_PATH (here: a copy of the wheel's, with new file
times, as a rebuild has) never restores a state the wheel's library saved."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PROMPT = "The history of the printing press, told in detail for a curious reader. " * 40


def _run(model: Path, home: Path, **env: str) -> subprocess.CompletedProcess:
    # A fresh process each time: LLAMA_CPP_LIB_PATH is read when the bindings load.
    full = {**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1", **env}
    return subprocess.run([sys.executable, "-m", "localinfer", "run", str(model), PROMPT, "--temp",
                           "0", "-n", "4", "--draft", "none", "-v"], capture_output=True,
                          text=True, env=full, stdin=subprocess.DEVNULL, timeout=300)


def test_a_swapped_library_misses_the_cache_of_another(smollm_path: Path, tmp_path: Path):
    from llama_cpp import llama_cpp
    copy = tmp_path / "lib"
    copy.mkdir()
    for lib in Path(llama_cpp._base_path).iterdir():
        shutil.copy(lib, copy / lib.name)          # contents alike, times new: a rebuild's mark
    home = tmp_path / "home"
    wheel = _run(smollm_path, home)
    swapped = _run(smollm_path, home, LLAMA_CPP_LIB_PATH=str(copy))
    again = _run(smollm_path, home, LLAMA_CPP_LIB_PATH=str(copy))
    assert wheel.returncode == swapped.returncode == again.returncode == 0, swapped.stderr
    assert "prompt cache: saved" in wheel.stderr
    assert "prompt cache: miss" in swapped.stderr and "prompt cache: hit" not in swapped.stderr
    assert "prompt cache: hit" in again.stderr            # its own entries it does reuse
    assert wheel.stdout == swapped.stdout == again.stdout
