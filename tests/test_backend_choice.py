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


# `auto` and MLX: the registry lists MLX first, but it is taken only where it is not passed over
# (off Apple Silicon with Metal, e.g. Linux with MLX's CPU build installed for the tests).
OFF_METAL = {"mlx": "picked automatically only on Apple Silicon with Metal"}


@pytest.mark.parametrize("requested, arch, available, not_here, expected, reason_has", [
    ("auto", "llama", MAC, {}, "mlx", "preferred"),                       # a Mac with Metal
    ("auto", "gemma3", MAC, {}, "mlx", "preferred"),
    ("auto", "phi3", MAC, {}, "llama.cpp", "mlx cannot run phi3"),          # arch MLX lacks
    ("auto", "llama", MAC, OFF_METAL, "llama.cpp", "Apple Silicon"),      # Linux, mlx[cpu] installed
    ("auto", None, MAC, OFF_METAL, "llama.cpp", "preferred"),             # `devices`: no model yet
    ("auto", "llama", {"mlx": False, "llama.cpp": True}, OFF_METAL, "llama.cpp", "preferred"),
    ("mlx", "llama", MAC, OFF_METAL, "mlx", "--backend"),                 # forced: runs on the CPU
])
def test_auto_and_mlx(requested, arch, available, not_here, expected, reason_has):
    choice = choose(requested, arch, available, NO_MLX_ARCH, not_here)
    assert choice.backend == expected
    assert reason_has in choice.reason


def test_auto_refuses_when_only_a_passed_over_backend_is_installed():
    with pytest.raises(UsageError):
        choose("auto", "llama", {"mlx": True, "llama.cpp": False}, NO_MLX_ARCH, OFF_METAL)
