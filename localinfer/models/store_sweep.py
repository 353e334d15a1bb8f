"""Sweep the store of temporary files that processes which died mid-write left behind.

A writer (quantize, auto-fit, a self-draft) writes `.<final>.<pid>.partial` beside the final name
(see `store.temp_path`) while holding the store lock for that name and quant, and renames it into
place when done. A `kill -9` leaves the temporary file for good; nothing else would ever remove it.

A temporary file is stale when its lock is free (nobody is writing that name and quant now) and
its writer is gone: the pid is not alive, or, because pids are reused, the file has not changed for
a day. Where advisory locks do not exist (Windows), only a file untouched for a day counts.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from localinfer.models.store import HAS_LOCKS, Store, is_safe_name

ABANDONED_S = 24 * 3600     # no writer leaves its temporary file untouched this long
_TEMP_FILE = re.compile(r"\.(?P<final>.+)\.(?P<pid>\d{1,10})\.partial")


def sweep(store: Store) -> list[Path]:
    """Delete the stale temporary files in every model folder; returns what was deleted."""
    removed = []
    for folder in store.model_folders():
        for path, quant, pid in _temp_files(folder):
            with store.try_lock(folder.name, quant) as free:
                if _stale(path, pid, lock_free=free):     # decided and done under the lock
                    path.unlink(missing_ok=True)
                    removed.append(path)
    return removed


def _temp_files(folder: Path) -> list[tuple[Path, str, int]]:
    """(path, quant, writer's pid) of each `.<name>-<QUANT>.gguf.<pid>.partial` in the folder."""
    found = []
    try:
        paths = list(folder.iterdir())
    except OSError:
        return []
    for path in paths:
        match = _TEMP_FILE.fullmatch(path.name)
        if match is None or path.is_dir():
            continue
        quant = match["final"].removeprefix(f"{folder.name}-").removesuffix(".gguf")
        if match["final"] == f"{folder.name}-{quant}.gguf" and is_safe_name(quant):
            found.append((path, quant, int(match["pid"])))
    return found


def _stale(path: Path, pid: int, *, lock_free: bool) -> bool:
    if pid == os.getpid():
        return False
    try:
        untouched = time.time() - path.lstat().st_mtime
    except OSError:
        return False          # already gone
    if not HAS_LOCKS:
        return untouched > ABANDONED_S
    return lock_free and (untouched > ABANDONED_S or not _alive(pid))


def _alive(pid: int) -> bool:
    if not 0 < pid < 2 ** 31:   # no process has such an id (and psutil would overflow)
        return False
    import psutil  # os.kill(pid, 0) would terminate the process on Windows
    return psutil.pid_exists(pid)
