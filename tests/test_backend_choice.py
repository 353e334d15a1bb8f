"""Backend selection as a pure function over described machines."""

import pytest

from localinfer.backends import choose
from localinfer.errors import UsageError

LLAMA_ONLY = {"llama.cpp": True}
MAC = {"mlx": True, "llama.cpp": True}          # a future registry order: MLX first on a Mac
NO_MLX_ARCH = lambda name, arch: not (name == "mlx" and arch == "phi3")


@pytest.mark.parametrize("requested, arch, available, expected", [
    ("auto", "llama", LLAMA_ONLY, "llama.cpp"),
    ("auto", None, LLAMA_ONLY, "llama.cpp"),
    ("llama.cpp", "gemma3", LLAMA_ONLY, "llama.cpp"),
    ("auto", "llama", MAC, "mlx"),
    ("auto", "phi3", MAC, "llama.cpp"),              # MLX cannot run it: fall through
    ("auto", "llama", {"mlx": False, "llama.cpp": True}, "llama.cpp"),
])
def test_choice(requested, arch, available, expected):
    assert choose(requested, arch, available, NO_MLX_ARCH).backend == expected


@pytest.mark.parametrize("requested, available", [
    ("cuda", LLAMA_ONLY), ("mlx", {"mlx": False, "llama.cpp": True}), ("auto", {"llama.cpp": False}),
])
def test_refusals(requested, available):
    with pytest.raises(UsageError):
        choose(requested, "llama", available, NO_MLX_ARCH)
