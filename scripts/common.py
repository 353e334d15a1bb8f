"""What the scripts share: the file a model name resolves to (found the way `localinfer` finds it),
a free local port, a server started and waited for, and tests/ on the import path for the references the tests measure against.

A script run as `python scripts/NAME.py` has scripts/ on sys.path, so `import common` finds this."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent


def quiet(message: str) -> None:
    """A notify callback that drops localinfer's notes."""


def to_stderr(message: str) -> None:
    """A notify callback that keeps stdout for the script's results."""
    print(message, file=sys.stderr)


def locate(model: str, *, offline: bool = True, progress: bool = False,
           notify: Callable[[str], None] = quiet):
    """(reference, GGUF file) for a catalogue name, Hub name or path, resolved by localinfer's own
    rules in the store LOCALINFER_HOME names. `offline` (the default) never downloads: a model not
    on disk is one clear error (localinfer's line, exit 1); with offline=False it is pulled first,
    as `localinfer run` would."""
    from localinfer.errors import LocalinferError
    from localinfer.models import refs
    try:
        _, catalogue, store = refs.context()
        ref = refs.parse_ref(model, catalogue)
    except LocalinferError as e:        # no such name: localinfer's one line
        raise SystemExit(f"error: {e}") from None
    try:
        return ref, refs.locate(ref, store, offline=offline, progress=progress, notify=notify)
    except LocalinferError as e:        # not in the store (offline), or the pull failed
        hint = f"; pull it first: localinfer pull {model}" if offline else ""
        raise SystemExit(f"error: {e}{hint}") from None


def model_file(model: str, *, offline: bool = True, progress: bool = False,
               notify: Callable[[str], None] = quiet) -> Path:
    """The GGUF file `model` resolves to (see `locate`)."""
    return locate(model, offline=offline, progress=progress, notify=notify)[1]


def gguf_file(text: str) -> Path:
    """An argparse type for a model file argument: a missing file is argparse's one error line."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"model file not found: {text} (docs/benchmarks.md, "
                                         "step 2, says how to pull the test models)")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], port: int, what: str, log=None) -> subprocess.Popen:
    """`cmd` (a server listening on `port`) started and answering /health. Its output goes to a
    temporary file (or `log`, a file open for writing and reading), never to a pipe nobody reads:
    llama-server logs every request, and once a pipe's buffer is full it blocks mid-request and
    the benchmark waits for ever."""
    log = log or tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}/health"
    for _ in range(1200):
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"error: {what} did not start: {log.read()[-500:]}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"error: {what} did not answer /health in 2 minutes")


def use_tests() -> None:
    """Put tests/ on sys.path: scripts import the tests' references (the float64 forward, the
    ONNX op recorder) rather than copies of them."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
