"""The model store: verified GGUF files on disk, one per model and quant.

Layout: `<models_dir>/<name>/<name>-<QUANT>.gguf`. A file only appears under its final name by an
atomic rename after it was verified, so whatever is listed here is whole.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from localinfer.errors import LocalinferError


@dataclass(frozen=True)
class StoredModel:
    name: str
    quant: str
    path: Path

    @property
    def size(self) -> int:
        return self.path.stat().st_size


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path_for(self, name: str, quant: str) -> Path:
        return self.root / name / f"{name}-{quant}.gguf"

    def partial_dir(self, name: str, quant: str) -> Path:
        """Where an interrupted download's pieces wait to be resumed."""
        return self.root / ".partial" / f"{name}-{quant}"

    def find(self, name: str, quant: str) -> Path | None:
        path = self.path_for(name, quant)
        return path if path.is_file() else None

    def installed(self) -> list[StoredModel]:
        found = []
        if not self.root.is_dir():
            return found
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir() and p.name[0] != "."):
            prefix = f"{folder.name}-"
            for f in sorted(folder.glob("*.gguf")):
                if f.stem.startswith(prefix):
                    found.append(StoredModel(folder.name, f.stem[len(prefix):], f))
        return found

    def remove(self, name: str, quant: str | None) -> list[Path]:
        targets = [m.path for m in self.installed()
                   if m.name == name and (quant is None or m.quant == quant)]
        for path in targets:
            path.unlink(missing_ok=True)
        folder = self.root / name
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty
        return targets

    @contextlib.contextmanager
    def lock(self, name: str, quant: str) -> Iterator[None]:
        """Serialise two processes pulling the same file; the second then finds it done."""
        lock_path = self.root / ".locks" / f"{name}-{quant}.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a") as handle:
            try:
                import fcntl
            except ImportError:  # Windows: no advisory lock; renames stay atomic regardless
                yield
                return
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def publish(tmp: Path, final: Path) -> None:
    """Move a finished file under its final name atomically (same file system)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, final)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise LocalinferError(f"cannot write {final}: {e.strerror}") from e
