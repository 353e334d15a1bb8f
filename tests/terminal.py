"""The real CLI on a real terminal (a pty, through pexpect): for what only a terminal shows, such
as help layout, progress bars, dimmed notes and the interactive chat."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pexpect

from helpers import MODELS_HOME


def spawn(*args: str, home: Path = MODELS_HOME, env: dict | None = None, columns: int = 80,
          timeout: float = 300) -> pexpect.spawn:
    """`python -m localinfer ARGS` on a pty of `columns` columns; stdout and stderr both land on
    it, as on a user's terminal. NO_COLOR is left unset unless `env` sets it."""
    full_env = {**os.environ, "LOCALINFER_HOME": str(home), "COLUMNS": str(columns),
                "TERM": "xterm", **(env or {})}
    full_env.pop("NO_COLOR", None) if "NO_COLOR" not in (env or {}) else None
    return pexpect.spawn(sys.executable, ["-m", "localinfer", *args], env=full_env,
                         encoding="utf-8", codec_errors="replace", timeout=timeout,
                         dimensions=(50, columns))


def run(*args: str, **kwargs) -> tuple[str, int]:
    """Run to the end on a pty: everything the terminal showed, and the exit code."""
    child = spawn(*args, **kwargs)
    output = child.read()
    child.close()
    return output, child.exitstatus if child.exitstatus is not None else 128 + child.signalstatus


_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def plain(screen: str) -> str:
    """What the terminal showed as text: colours, styles and cursor moves dropped, CRLF as LF."""
    return _ESCAPES.sub("", screen).replace("\r\n", "\n")
