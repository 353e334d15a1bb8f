"""`chat`'s line history is a file of ours: read as the store reads its files (never through a
link, never a pipe, no more than a bound) and written by rename, so nothing else is truncated."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from helpers import run_cli

from localinfer import settings
from localinfer.cli.chat import HISTORY_BYTES
from localinfer.models import safe_files

CHAT = ("chat", "--temp", "0", "-n", "8")


def _history_path(home: Path, monkeypatch) -> Path:
    monkeypatch.setenv("LOCALINFER_HOME", str(home))
    path = settings.load().chat_history
    path.parent.mkdir(parents=True)
    return path


def _chat(model: Path, home: Path, *, timeout: float = 120) -> tuple[int, str, int]:
    """(exit code, stderr, peak memory in bytes) of a short piped chat, measured for that process
    alone (wait4), and failed if it does not end within `timeout`."""
    import subprocess
    env = {**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1"}
    (home / "in.txt").write_text("Say hello.\n/exit\n")
    with open(home / "in.txt", "rb") as stdin, open(home / "err.txt", "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "localinfer", CHAT[0], str(model), *CHAT[1:]],
                                stdin=stdin, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            pytest.fail(f"chat did not end within {timeout} s")
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return proc.returncode, (home / "err.txt").read_text(), peak


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "warning" in line or "error" in line]


def test_a_link_at_the_history_path_leaves_the_file_it_points_to_alone(smollm_path, tmp_path,
                                                                       monkeypatch):
    outside = tmp_path / "notes.txt"
    outside.write_text("".join(f"line {i} of a file that is not ours\n" for i in range(1500)))
    before = outside.read_bytes()
    history = _history_path(tmp_path / "home", monkeypatch)
    history.symlink_to(outside)
    result = run_cli(*CHAT[:1], str(smollm_path), *CHAT[1:], input="Say hello.\n/exit\n",
                     home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    assert outside.read_bytes() == before
    assert history.is_symlink()
    assert _warnings(result.stderr) == [f"localinfer: warning: {history} is a symbolic link; "
                                        "chat history is neither read nor kept"], result.stderr


def test_a_pipe_at_the_history_path_does_not_hang_chat(smollm_path, tmp_path, monkeypatch):
    history = _history_path(tmp_path / "home", monkeypatch)
    os.mkfifo(history)
    code, stderr, _ = _chat(smollm_path, tmp_path / "home", timeout=120)
    assert code == 0, stderr
    assert _warnings(stderr) == [f"localinfer: warning: {history} is not a regular file; "
                                 "chat history is neither read nor kept"], stderr


def test_a_huge_history_is_read_only_as_far_as_its_tail(smollm_path, tmp_path, monkeypatch):
    small_home, huge_home = tmp_path / "small", tmp_path / "huge"
    _history_path(small_home, monkeypatch).write_text("an earlier line\n")
    huge = _history_path(huge_home, monkeypatch)
    with open(huge, "wb") as f:           # 300 MB that cost no disk: a hole, then the lines
        f.truncate(300 << 20)
        f.seek(0, os.SEEK_END)
        f.write(b"\na line readline cannot hold: \0\nthe newest line\n")
    code, stderr, small_peak = _chat(smollm_path, small_home)
    assert code == 0, stderr
    code, stderr, huge_peak = _chat(smollm_path, huge_home)
    assert code == 0, stderr
    # Reading the whole file would cost at least its 300 MB; the tail costs HISTORY_BYTES.
    assert huge_peak - small_peak < 100 << 20, (small_peak, huge_peak)
    assert huge.read_text() == "the newest line\n"        # what the tail held, rewritten
    assert (small_home / "data" / "chat_history").read_text() == "an earlier line\n"


# -- the file helpers themselves ---------------------------------------------------------------

def test_read_last_lines_reads_no_further_back_than_the_bound(tmp_path):
    path = tmp_path / "history"
    path.write_text("".join(f"entry {i:06d}\n" for i in range(100_000)))   # 1.3 MB
    lines = safe_files.read_last_lines(path, max_bytes=HISTORY_BYTES)
    assert lines[-1] == "entry 099999"
    assert 0 < len("\n".join(lines)) <= HISTORY_BYTES
    assert all(len(line) == len("entry 000000") for line in lines)     # no cut line at the start
    assert safe_files.read_last_lines(tmp_path / "absent", max_bytes=10) == []


def test_replace_writes_by_rename_and_never_through_a_link(tmp_path):
    path = tmp_path / "history"
    path.write_text("old\n")
    inode = path.stat().st_ino
    safe_files.replace(path, b"new\n")
    assert path.read_text() == "new\n" and path.stat().st_ino != inode
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    target = tmp_path / "target"
    target.write_text("keep me\n")
    path.unlink()
    path.symlink_to(target)
    with pytest.raises(safe_files.NotAFile):
        safe_files.replace(path, b"new\n")
    assert target.read_text() == "keep me\n" and path.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history", "target"]   # no temporary left
