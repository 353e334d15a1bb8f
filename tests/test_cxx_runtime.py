"""libstdc++ is in the global symbol scope before libllama loads (backends/llama/cxx_runtime.py):
the CUDA build's crash that this prevents can only be seen on a GPU machine (docs/gpu.md), the
lookup order that prevents it is checked here."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF symbol scopes")

# Whether std::locale::classic() resolves in the process's global scope, before and after the
# llama backend's package is imported and a model's bindings are loaded.
PROBE = """
import ctypes
def global_scope_has_cxx():
    return hasattr(ctypes.CDLL(None), "_ZNSt6locale7classicEv")
before = global_scope_has_cxx()
import localinfer.backends.llama as llama
after_import = global_scope_has_cxx()
llama.bindings.engine()
print(before, after_import, global_scope_has_cxx())
"""


def test_libstdcxx_is_global_before_libllama_loads():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "False", "the interpreter already has libstdc++ global: nothing to show"
    assert out[1:] == ["True", "True"]
