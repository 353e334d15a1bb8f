"""The model store: verified GGUF files on disk, one per model and quant.

Layout: `<models_dir>/<name>/<name>-<QUANT>.gguf` (a split model: its parts side by side as
`<name>-<QUANT>-0000K-of-0000N.gguf`, as llama.cpp loads them; a multimodal model's projector
beside them as `<name>-MMPROJ.gguf`, never listed as a quant), locks in `.locks/`, resumable
downloads in `.partial/<name>/<QUANT>/`. A file only appears under its final name by an atomic rename after it
was verified, so whatever is listed here is whole.

Names and quant tags come from the catalogue, the user's config and the command line; they become
path components only through `check_name`, and every path the store builds must resolve inside its
root, so nothing is ever written or deleted elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from localinfer.errors import LocalinferError, UsageError
from localinfer.gguf.split import SPLIT_NAME, part_name

try:
    import fcntl
except ImportError:         # Windows: no advisory locks; renames stay atomic regardless
    fcntl = None  # type: ignore[assignment]
HAS_LOCKS = fcntl is not None

# The one safe-name rule. A letter or digit first (so never '.', '..' or a hidden name: those are
# the store's own temporaries and locks), then letters, digits and . _ + -, not ending in '.'
# (Windows drops it), at most 80 characters (two of them and a suffix stay under 255 bytes).
_SAFE_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._+-]{0,78}[A-Za-z0-9_+-])?")
# Device names Windows resolves in any folder, with any extension.
_WINDOWS_DEVICES = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(10)),
                    *(f"LPT{i}" for i in range(10))}
PROJECTOR = "MMPROJ"          # the quant tag a model's projector is stored under (not a model)
SAFE_NAME_RULE = ("letters, digits, '.', '_', '+' and '-', starting with a letter or digit, "
                  "at most 80 characters")


def is_safe_name(value: object) -> bool:
    """Whether `value` may become one path component in the store (see `SAFE_NAME_RULE`)."""
    return (isinstance(value, str) and _SAFE_NAME.fullmatch(value) is not None
            and value.split(".")[0].upper() not in _WINDOWS_DEVICES)


def check_name(value: str, what: str = "model name") -> str:
    """`value` unchanged if it is safe as a path component; a UsageError (exit 2) otherwise."""
    if not is_safe_name(value):
        raise UsageError(f"{value!r} is not a valid {what}: use {SAFE_NAME_RULE}")
    return value


def to_safe_name(text: str) -> str:
    """A safe name made from free text such as a file's stem ('My Model v2' → 'my-model-v2').

    The result still goes through `check_name` wherever it is used; this only makes that pass for
    names that were never typed as names."""
    return re.sub(r"[^a-z0-9._+-]+", "-", text.lower()).strip("._+-")[:80].rstrip(".")


@dataclass(frozen=True)
class StoredModel:
    name: str
    quant: str
    path: Path                      # the file to load: a split model's first part
    parts: tuple[Path, ...] = ()    # every part of a split model, in order

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.parts or (self.path,))


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path_for(self, name: str, quant: str) -> Path:
        check_name(name)
        check_name(quant, "quant tag")
        return self._inside(self.root / name / f"{name}-{quant}.gguf")

    def partial_dir(self, name: str, quant: str) -> Path:
        """Where an interrupted download's pieces wait to be resumed."""
        check_name(name)
        check_name(quant, "quant tag")
        return self._inside(self.root / ".partial" / name / quant)

    def split_path(self, name: str, quant: str, no: int, count: int) -> Path:
        """Where part `no` (from 1) of a model split in `count` files goes."""
        check_name(name)
        check_name(quant, "quant tag")
        return self._inside(self.root / name / part_name(f"{name}-{quant}", no, count))

    def find(self, name: str, quant: str) -> Path | None:
        """The file to load for a model and quant: the whole file, or the first part of a split
        model whose parts are all there; None when neither is."""
        path = self.path_for(name, quant)
        if path.is_file():
            return path
        split = next((m for m in self._in_folder(path.parent) if m.quant == quant), None)
        return split.path if split else None

    def installed(self) -> list[StoredModel]:
        return [m for folder in self.model_folders() for m in self._in_folder(folder)]

    def _in_folder(self, folder: Path) -> list[StoredModel]:
        """The models in one folder: whole files, and split models with every part there."""
        found: list[StoredModel] = []
        prefix = f"{folder.name}-"
        for f in sorted(folder.glob("*.gguf")) if folder.is_dir() else ():
            if not f.stem.startswith(prefix):
                continue
            split = SPLIT_NAME.fullmatch(f.name)
            if split is None:
                if is_safe_name(f.stem[len(prefix):]) and f.stem[len(prefix):] != PROJECTOR:
                    found.append(StoredModel(folder.name, f.stem[len(prefix):], f))
                continue
            quant, count = split["prefix"][len(prefix):], int(split["count"])
            parts = tuple(f.with_name(part_name(split["prefix"], k, count))
                          for k in range(1, count + 1))
            if split["no"] == "00001" and is_safe_name(quant) and all(p.is_file() for p in parts):
                found.append(StoredModel(folder.name, quant, f, parts))
        return found

    def model_folders(self) -> list[Path]:
        """The real folders under the root that can hold a model (never a symlink out of it)."""
        try:
            entries = sorted(self.root.iterdir())
        except OSError:
            return []
        return [p for p in entries if is_safe_name(p.name) and p.is_dir() and not p.is_symlink()]

    def remove(self, name: str, quant: str | None) -> list[Path]:
        """Delete a model's files (every quant, or one) and its resumable downloads; what went."""
        check_name(name)
        if quant is not None:
            check_name(quant, "quant tag")
        targets = self._files_of(name, quant)
        for path in targets:
            self._inside(path).unlink(missing_ok=True)
        folder = self.root / name
        if folder.is_dir() and not folder.is_symlink():
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
        return targets + self._remove_downloads(name, quant)

    def _files_of(self, name: str, quant: str | None) -> list[Path]:
        """A model's files (every quant, or one): whole files and split parts, also the parts of
        a split model whose publishing was cut short (its first part comes last)."""
        files = [m.path for m in self.installed() if m.name == name and quant in (None, m.quant)
                 and not m.parts]
        folder = self.root / name
        real = folder.is_dir() and not folder.is_symlink()    # never a link out of the store
        projector = folder / f"{name}-{PROJECTOR}.gguf"
        if quant is None and real and projector.is_file():     # the model's last file goes
            files.append(projector)
        for f in sorted(folder.glob("*.gguf")) if real else ():
            split = SPLIT_NAME.fullmatch(f.name)
            tag = split["prefix"].removeprefix(f"{name}-") if split else ""
            if split and split["prefix"] != tag and is_safe_name(tag) and quant in (None, tag):
                files.append(f)
        return files

    def _remove_downloads(self, name: str, quant: str | None) -> list[Path]:
        """Pieces of interrupted pulls of this model, unless a pull is resuming them right now."""
        folder = self.root / ".partial" / name
        if not folder.is_dir() or folder.is_symlink():
            return []
        removed = []
        for piece in sorted(folder.iterdir()):
            if quant not in (None, piece.name) or not is_safe_name(piece.name) or \
                    piece.is_symlink() or not piece.is_dir():
                continue
            with self.try_lock(name, piece.name) as free:
                if free:
                    shutil.rmtree(piece, ignore_errors=True)
                    removed.append(piece)
        with contextlib.suppress(OSError):
            folder.rmdir()
        return removed

    @contextlib.contextmanager
    def lock(self, name: str, quant: str) -> Iterator[None]:
        """Serialise two processes writing the same file; the second then finds it done."""
        with self._lock_file(name, quant) as handle:
            if HAS_LOCKS:
                fcntl.flock(handle, fcntl.LOCK_EX)   # released when the file is closed
            yield

    @contextlib.contextmanager
    def try_lock(self, name: str, quant: str) -> Iterator[bool]:
        """Take the lock only if nobody holds it: yields whether this process now holds it.

        Every writer of a store file holds its lock while writing, so a free lock means nothing is
        being written under that name and quant (on this machine, or over a file system that
        shares locks). Where there are no advisory locks (Windows) this yields False."""
        with self._lock_file(name, quant) as handle:
            if not HAS_LOCKS:
                yield False
                return
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True

    def _lock_file(self, name: str, quant: str) -> BinaryIO:
        """The open lock file of a name and quant (never a symlink planted in its place)."""
        check_name(name)
        check_name(quant, "quant tag")
        lock_path = self._inside(self.root / ".locks" / f"{name}-{quant}.lock")
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        return open(os.open(lock_path, flags, 0o644), "r+b")

    def _inside(self, path: Path) -> Path:
        """`path`, after checking that its folder resolves inside the root.

        Names are already safe components, so only a symlinked folder can lead elsewhere; the
        file itself may be a link (reading follows it; unlinking or replacing removes only it)."""
        root = os.path.realpath(self.root)
        folder = os.path.realpath(path.parent)
        if os.path.commonpath([root, folder]) != root:
            raise LocalinferError(f"{path.parent} leads outside the model store ({self.root}); "
                                  "refusing to write or delete there")
        return path


def temp_path(final: Path) -> Path:
    """The temporary name a writer uses beside `final` until the file is complete.

    Hidden, and carrying the writer's pid, so that `store_sweep` can tell leftovers of a process
    that died mid-write from a file being written now."""
    return final.with_name(f".{final.name}.{os.getpid()}.partial")


def publish(tmp: Path, final: Path) -> None:
    """Move a finished file under its final name atomically (same file system)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, final)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise LocalinferError(f"cannot write {final}: {e.strerror}") from e
