"""`localinfer quantize` end to end on the real SmolLM2 file, plus the planner's pure parts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from localinfer.errors import LocalinferError, UsageError
from localinfer.gguf.header import read_header
from localinfer.quant import imatrix, quantize

pytestmark = pytest.mark.slow


def test_parse_type_aliases_and_refusal():
    assert quantize.parse_type("q4_k") == "Q4_K_M"
    assert quantize.parse_type("bf16") == "BF16"
    with pytest.raises(UsageError, match="valid types: F32, F16"):
        quantize.parse_type("Q9_0")


def test_store_name_strips_the_quant_suffix():
    assert quantize.store_name_for(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "smollm2-135m-instruct"
    assert quantize.store_name_for(Path("gemma-3-270m-q4_k_m.gguf")) == "gemma-3-270m"


def test_not_enough_disk_space_is_refused(tmp_path: Path):
    with pytest.raises(LocalinferError, match="not enough disk space"):
        quantize.check_space(tmp_path, 1 << 60)


def test_quantize_into_the_store_then_run_list_rm(smollm_path: Path, home: Path):
    dry = run_cli("quantize", str(smollm_path), "--type", "Q5_K_M", "--dry-run", "--json", home=home)
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert planned["requantizes"] == ["Q4_1"] and planned["memory"]["4096"]["total"] > 0
    refused = run_cli("quantize", str(smollm_path), "--type", "Q5_K_M", home=home)
    assert refused.returncode == 2 and "--allow-requantize" in refused.stderr
    done = run_cli("quantize", str(smollm_path), "--type", "Q5_K_M", "--allow-requantize", home=home)
    assert done.returncode == 0, done.stderr
    assert "compounds" in done.stderr                       # the requantization warning
    stored = home / "data/models/smollm2-135m-instruct/smollm2-135m-instruct-Q5_K_M.gguf"
    assert stored.stat().st_size == planned["file_size"]      # the dry run's size is exact
    answer = run_cli("run", "smollm2:Q5_K_M", "Say hi", "-n", "4", "--temp", "0", home=home)
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
    assert "Q5_K_M" in run_cli("list", home=home).stdout
    again = run_cli("quantize", str(smollm_path), "--type", "Q5_K_M", "--allow-requantize", home=home)
    assert again.returncode == 2 and "--force" in again.stderr
    assert run_cli("rm", "smollm2:Q5_K_M", home=home).returncode == 0
    assert not stored.exists()


def test_f16_target_with_output_path(smollm_path: Path, tmp_path: Path):
    out = tmp_path / "f16.gguf"
    done = run_cli("quantize", str(smollm_path), "--type", "F16", "--allow-requantize",
                   "-o", str(out), "--threads", "1", home=tmp_path / "home")
    assert done.returncode == 0, done.stderr
    types = {t.type_name for t in read_header(out).tensors}
    assert types == {"F16", "F32"}
    assert not list(tmp_path.glob(".*partial"))


@pytest.mark.parametrize("content, reason", [(b"not a model at all", "not a GGUF"),
                                              (b"GGUF\x03\x00", "truncated")])
def test_bad_inputs_are_refused(tmp_path: Path, content: bytes, reason: str):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    result = run_cli("quantize", str(bad), "--type", "Q4_0", "-o", str(tmp_path / "o.gguf"),
                     home=tmp_path / "home")
    assert result.returncode == 1 and reason in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.gguf").exists()


def test_unknown_type_lists_valid_ones(smollm_path: Path, tmp_path: Path):
    result = run_cli("quantize", str(smollm_path), "--type", "Q7_K", home=tmp_path)
    assert result.returncode == 2 and "Q4_K_M" in result.stderr


def _ones_imatrix(model: Path, path: Path, extra: int = 0) -> Path:
    header = read_header(model)
    imatrix.save_legacy(path, {t.name: np.ones(t.shape[0] + extra, np.float32)
                               for t in header.tensors if t.name.startswith("blk.") and len(t.shape) == 2})
    return path


def test_iq2_needs_an_imatrix_that_matches(smollm_path: Path, tmp_path: Path):
    out = tmp_path / "iq2.gguf"
    missing = run_cli("quantize", str(smollm_path), "--type", "IQ2_XXS", "--allow-requantize",
                      "-o", str(out), home=tmp_path)
    assert missing.returncode == 2 and "--imatrix" in missing.stderr
    wrong = _ones_imatrix(smollm_path, tmp_path / "wrong.imatrix", extra=1)
    mismatch = run_cli("quantize", str(smollm_path), "--type", "IQ2_XXS", "--allow-requantize",
                       "--imatrix", str(wrong), "-o", str(out), home=tmp_path)
    assert mismatch.returncode == 2 and "does not match this model" in mismatch.stderr
    good = _ones_imatrix(smollm_path, tmp_path / "good.imatrix")
    planned = run_cli("quantize", str(smollm_path), "--type", "IQ2_XXS", "--imatrix", str(good),
                      "-o", str(out), "--dry-run", "--json", home=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["needs_imatrix"] is False
    assert not out.exists()


def test_interrupted_quantization_leaves_no_file(gemma_path: Path, tmp_path: Path):
    out = tmp_path / "out" / "q8.gguf"
    proc = subprocess.Popen([sys.executable, "-m", "localinfer", "quantize", str(gemma_path),
                             "--type", "Q8_0", "--allow-requantize", "-o", str(out)],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(out.parent.glob(".*.partial")) and time.monotonic() < deadline:
        time.sleep(0.05)                     # interrupt once the writing has begun
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    if out.exists():
        pytest.skip("quantization finished before the interrupt arrived")
    assert proc.returncode == 130
    assert not out.exists() and not list(out.parent.glob("*"))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M", "IQ4_XS", "Q2_K", "F16"])
def test_the_disk_space_bound_is_never_below_the_exact_size(smollm_path: Path, gemma_path: Path,
                                                             qtype: str):
    # The bound (header only) stands in for the dry run before every write; the dry run's exact
    # size is what llama.cpp writes (checked above), across both models' row widths and fallbacks.
    for model in (smollm_path, gemma_path):
        header = read_header(model)
        exact = quantize.plan(model, qtype).file_size
        assert exact <= quantize.size_bound(header, qtype) <= 2.2 * exact, (model.name, qtype)


def test_type_table_matches_gguf():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from localinfer.gguf.header import GGML_TYPES
    assert GGML_TYPES == {t.value: (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType
                          if t.value in GGML_TYPES}


def test_direct_binding_matches_the_packages_declarations():
    # The quantizer binds libllama without importing llama_cpp; its structs must be the package's.
    import ctypes

    from llama_cpp import llama_cpp as package

    from localinfer.backends.llama import quantize as ours

    def layout(struct):
        fields = [getattr(struct, name) for name, *_ in struct._fields_]
        return ctypes.sizeof(struct), [(f.offset, f.size) for f in fields], \
            [name for name, *_ in struct._fields_]
    assert layout(ours.QuantizeParams) == layout(package.llama_model_quantize_params)
    assert layout(ours._ImatrixEntry) == layout(package.llama_model_imatrix_data)
    assert layout(ours._KvOverride) == layout(package.llama_model_kv_override)


def test_quantizing_hands_the_log_back(smollm_path: Path):
    # In one process the llama.cpp backend routes the engine's log; a quantization borrows it.
    import ctypes

    from localinfer.backends.llama import engine as llama_cpp, quantize as llama_quantize
    llama_cpp.init_engine(verbose=False)          # the backend's router, as after loading a model

    def current() -> int | None:
        callback, data = llama_quantize._LogCallback(), ctypes.c_void_p()
        llama_quantize._engine().log_get(ctypes.byref(callback), ctypes.byref(data))
        return ctypes.cast(callback, ctypes.c_void_p).value

    before = current()
    quantize.plan(smollm_path, "Q4_0")
    assert current() == before
