"""Where prompt-cache entries live, and the checks that keep every read, write and delete inside
the cache root.

Layout: `<root>/<key>/<entry>.kv`, exactly one level of key folders. The root itself may be a
symlink (a cache moved to another disk on purpose); nothing below it is followed. A key folder
replaced by a symlink would otherwise let eviction delete `*.kv` files elsewhere and saves write
there: such a folder is not listed, and replaced by a real one before a save.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"


def is_key_dir(root: Path, folder: Path) -> bool:
    """Whether `folder` is a real directory directly inside `root` (not a link to one)."""
    try:
        mode = os.lstat(folder).st_mode
    except OSError:
        return False
    return stat.S_ISDIR(mode) and os.path.realpath(folder) == os.path.join(
        os.path.realpath(root), folder.name)


def key_dirs(root: Path) -> list[Path]:
    try:
        with os.scandir(root) as it:
            names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    return [root / name for name in sorted(names)]


def files_in(root: Path, folder: Path, *, temporary: bool = False) -> list[Path]:
    """The regular `*.kv` files of one key folder (temporaries instead with `temporary`); none when
    the folder is not a real key folder of `root`."""
    if not is_key_dir(root, folder):
        return []
    try:
        with os.scandir(folder) as it:
            names = [e.name for e in it if e.name.endswith(SUFFIX)
                     and e.name.startswith(TEMP_PREFIX) == temporary
                     and e.is_file(follow_symlinks=False)]
    except OSError:
        return []
    return [folder / name for name in sorted(names)]


def all_files(root: Path, *, temporary: bool = False) -> list[Path]:
    """The entry files of every key folder under root."""
    return [p for folder in key_dirs(root) for p in files_in(root, folder, temporary=temporary)]


def remove(root: Path, path: Path) -> None:
    """Delete an entry file if it is where an entry belongs; another process may have deleted it
    first. A file reached through a symlinked folder is left alone."""
    if is_key_dir(root, path.parent):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def prepare_key_dir(root: Path, folder: Path) -> bool:
    """Make `folder` a real key folder of `root` before a save; False when it cannot be.

    Whatever else sits under the key's name (a symlink, a file) is a damaged cache: it is removed
    itself, never what it points to."""
    if is_key_dir(root, folder):
        return True
    try:
        if os.path.lexists(folder):
            os.unlink(folder)           # a link or a file: unlinking never touches a target
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return is_key_dir(root, folder)
