"""Every mistake a user can make ends as one `localinfer: error:` line, the documented exit code,
nothing on stdout and no traceback (unless --debug). Drives the real CLI on the real models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import error_line, run_cli

from localinfer.gguf.header import read_header

EXIT_RUNTIME, EXIT_USAGE = 1, 2
FAST = ("--temp", "0", "-n", "8")          # keeps the cases that do load a model quick


def assert_store_intact(home: Path) -> None:
    """No temporary file outside .partial, and every published model has a whole GGUF header."""
    models = home / "data" / "models"
    if not models.is_dir():
        return
    for tmp in models.rglob("*.tmp"):
        assert ".partial" in tmp.relative_to(models).parts, tmp
    for folder in (p for p in models.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for gguf in folder.glob("*.gguf"):
            read_header(gguf)               # raises on a truncated or foreign file


# -- model names ----------------------------------------------------------------------------------
def test_unknown_model_suggests_close_name(models_home):
    result = run_cli("run", "smolm2", "hi", "--offline", *FAST, home=models_home)
    assert result.returncode == EXIT_USAGE
    assert "smollm2" in error_line(result)
    assert_store_intact(models_home)


def test_unknown_quant_lists_available_ones(models_home):
    result = run_cli("run", "smollm2:Q9_9", "hi", "--offline", *FAST, home=models_home)
    assert result.returncode == EXIT_USAGE
    line = error_line(result)
    assert "Q9_9" in line and "Q4_1" in line and "Q8_0" in line
    assert_store_intact(models_home)


# -- bad model files ------------------------------------------------------------------------------
def test_text_file_is_not_a_model(tmp_path, models_home):
    bad = tmp_path / "x.gguf"
    bad.write_text("this is not a model\n")
    result = run_cli("run", str(bad), "hi", *FAST, home=models_home)
    assert result.returncode == EXIT_RUNTIME
    assert "not a GGUF" in error_line(result)


def test_empty_file_is_not_a_model(tmp_path, models_home):
    empty = tmp_path / "empty.gguf"
    empty.touch()
    result = run_cli("run", str(empty), "hi", *FAST, home=models_home)
    assert result.returncode == EXIT_RUNTIME
    assert "empty.gguf" in error_line(result)


def test_truncated_model_is_reported(tmp_path, models_home, smollm_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as src:
        cut.write_bytes(src.read(50_000_000))
    result = run_cli("run", str(cut), "hi", *FAST, home=models_home)
    assert result.returncode == EXIT_RUNTIME
    line = error_line(result)
    assert "truncated" in line or "corrupt" in line
    assert_store_intact(models_home)


def test_architecture_llama_cpp_does_not_know(tmp_path, models_home):
    import gguf
    path = tmp_path / "notamodel.gguf"
    writer = gguf.GGUFWriter(str(path), "notamodel")
    writer.add_tensor("weight", np.zeros(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_cli("run", str(path), "hi", *FAST, home=models_home)
    assert result.returncode == EXIT_RUNTIME
    assert "unknown model architecture: 'notamodel'" in error_line(result)


# -- prompts --------------------------------------------------------------------------------------
def test_prompt_longer_than_context(models_home, smollm_path):
    prompt = "the quick brown fox jumps over the lazy dog " * 100
    result = run_cli("run", str(smollm_path), prompt, "--ctx", "64", *FAST, home=models_home)
    assert result.returncode == EXIT_RUNTIME
    assert "tokens but --ctx 64 holds 64; raise --ctx" in error_line(result)


def test_empty_prompt_argument(models_home):
    result = run_cli("run", "smollm2", "", "--offline", *FAST, home=models_home)
    assert result.returncode == EXIT_USAGE
    assert "prompt is empty" in error_line(result)


def test_whitespace_only_stdin(models_home):
    result = run_cli("run", "smollm2", "--offline", *FAST, input="  \n\t\n", home=models_home)
    assert result.returncode == EXIT_USAGE
    assert "prompt is empty" in error_line(result)


# -- option values --------------------------------------------------------------------------------
@pytest.mark.parametrize("option, value", [
    ("--temp", "-1"),
    ("--top-p", "0"),
    ("--top-p", "1.5"),
    ("--min-p", "1"),
    ("--repeat-penalty", "0"),
    ("--max-tokens", "0"),
    ("--ctx", "-5"),
    ("--backend", "cuda"),
])
def test_invalid_option_value(models_home, option, value):
    result = run_cli("run", "smollm2", "hi", "--offline", option, value, home=models_home)
    assert result.returncode == EXIT_USAGE
    assert option in error_line(result) or value in error_line(result)


def test_unknown_backend_is_refused_before_pulling(home):
    result = run_cli("run", "smollm2", "hi", "--backend", "cuda", home=home)
    assert result.returncode == EXIT_USAGE
    assert "cuda" in error_line(result)
    assert not list(home.rglob("*.gguf"))


# -- --debug and --offline ------------------------------------------------------------------------
def test_debug_shows_traceback(tmp_path, models_home):
    bad = tmp_path / "x.gguf"
    bad.write_text("not a model")
    result = run_cli("--debug", "run", str(bad), "hi", *FAST, home=models_home)
    assert result.returncode == EXIT_RUNTIME
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("localinfer: error: ")
    assert result.stdout == ""


def test_offline_without_the_model_on_disk(home):
    result = run_cli("run", "smollm2", "hi", "--offline", *FAST, home=home)
    assert result.returncode == EXIT_RUNTIME
    assert "--offline" in error_line(result)
    assert not list(home.rglob("*.gguf"))
