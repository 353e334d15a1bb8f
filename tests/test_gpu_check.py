"""scripts/gpu_check.py without a GPU: its arguments, its table, its exit rule, and the probe's
plumbing on a described GPU (the engine here is a CPU build; the check itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from localinfer.backends.llama import devices as llama_devices
from localinfer.backends.llama.devices import Device

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
MiB = 1 << 20


def speed_row(test: str, theirs: float, ours: float) -> dict:
    return {"test": test, "llama_bench_tps": theirs, "localinfer_tps": ours,
            "paired_ratio": ours / theirs}


def row(tg_ratio: float = 1.0, estimate: int = 1000 * MiB, in_use: int = 1000 * MiB) -> dict:
    memory = {"estimate": estimate, "in_use": in_use, "n_ctx": 4096,
              "offload": {"gpu_layers": 31, "layers": 31}}
    return gpu_check.build_row("m.gguf", speed_row("pp512", 5000, 4900),
                               speed_row("tg128", 200, 200 * tg_ratio), memory, "identical")


@pytest.mark.parametrize("tg_ratio, in_use, failed", [
    (1.0, 1000, []),
    (0.95, 1099, []),                        # on the edges: passes
    (0.949, 1000, ["decode at 0.949x llama-bench, below 0.95x"]),
    (1.0, 1101, ["outside ±10%"]),
    (1.0, 899, ["outside ±10%"]),
    (0.5, 2000, ["below 0.95x", "outside ±10%"]),
])
def test_exit_rule(tg_ratio, in_use, failed):
    found = gpu_check.failures(row(tg_ratio, in_use=in_use * MiB))
    assert len(found) == len(failed)
    for line, words in zip(found, failed):
        assert words in line and line.startswith("m.gguf: ")


def test_no_estimate_fails():
    assert "no estimate" in gpu_check.failures(row(estimate=0))[0]


def test_table():
    table = gpu_check.format_table("GPU: CUDA0 (H200)", [row(), row(0.9)])
    lines = table.splitlines()
    assert lines[0] == "GPU: CUDA0 (H200)" and lines[1] == ""
    assert lines[2].startswith("| model | pp512 llama-bench |") and len(lines) == 6
    assert lines[4] == ("| m.gguf | 5000.0 | 4900.0 | 0.980 | 200.0 | 200.0 | 1.000 | 31/31 "
                        "| identical | 1000 MiB | 1000 MiB | 1.000 | ok |")
    assert lines[5].endswith("| FAIL |")


def test_greedy_comparison():
    assert gpu_check.same_text("abc", "abc") == "identical"
    assert gpu_check.same_text("abX", "abc") == "differs at char 2 of 3"
    assert gpu_check.same_text("ab", "abc") == "differs at char 2 of 3"


@pytest.mark.parametrize("argv, message", [
    ([], "give at least one GGUF model"),
    (["m.gguf", "-r", "0"], "--repetitions must be at least 1"),
    (["m.gguf", "--ctx", "-5"], "--ctx must be at least 1"),
    (["m.gguf", "--rounds", "x"], "invalid int value"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as ended:
        gpu_check.parse_args(argv)
    assert ended.value.code == 2 and message in capsys.readouterr().err


def test_on_this_cpu_build_it_says_it_cannot_check(tmp_path, smollm_path):
    """Exit 2 with one line, before anything is built."""
    result = subprocess.run([sys.executable, str(SCRIPT), str(smollm_path),
                             "--build-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert "error: the installed llama.cpp has no GPU backend" in result.stderr
    assert result.stdout == "" and not any(tmp_path.iterdir())
    # The GPU is asked for first: without one, a missing model changes nothing of the answer.
    missing = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.gguf")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "has no GPU backend" in missing.stderr


def test_gpu_backend_names_the_build():
    gpus = [{"backend": "CUDA"}]
    assert gpu_check.gpu_backend(gpus) == "CUDA"
    with pytest.raises(gpu_check.CannotCheck, match="no llama-bench build is known for the RPC"):
        gpu_check.gpu_backend([{"backend": "RPC"}])


FAKE = [Device("CPU", "a CPU", "cpu", "CPU", 16 << 30, 16 << 30),
        Device("CUDA0", "Fake GPU", "gpu", "CUDA", 8 << 30, 8 << 30)]


@pytest.mark.slow
def test_probe_on_a_described_gpu(monkeypatch, models_home, smollm_path):
    """The probe's path through the engine: the estimate of what the GPU holds, the device
    readings around a real load (a fake GPU's free memory does not move), where the layers went."""
    monkeypatch.setattr(llama_devices, "read_registry", lambda: list(FAKE))
    result = gpu_check.probe(smollm_path, 4096)
    assert result["gpus"] == [FAKE[1].as_dict()]
    assert result["in_use"] == 0 and result["n_ctx"] == 4096
    # SmolLM2 Q4_1 (98 MB) with a 4096-token f16 KV cache (94 MB) and its compute buffer.
    assert 190 * MiB < result["estimate"] < 230 * MiB
    assert result["offload"]["gpu_layers"] == result["offload"]["layers"] == 31


def test_the_whole_check_with_the_hardware_stubbed(monkeypatch, tmp_path, capsys):
    """run() on stubbed measurements: one table on stdout, the failures on stderr, exit 1."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    probes = {None: {"gpus": [FAKE[1].as_dict()]},
              model: {"estimate": 100 * MiB, "in_use": 130 * MiB, "n_ctx": 4096,
                      "offload": {"gpu_layers": 31, "layers": 31}}}
    monkeypatch.setattr(gpu_check, "run_probe", lambda m, ctx: probes[m])
    monkeypatch.setattr(gpu_check, "build_llama_bench", lambda backend, args: Path("llama-bench"))
    monkeypatch.setattr(gpu_check, "greedy_text", lambda m, layers: "same")
    monkeypatch.setattr(gpu_check.lb, "bench_model", lambda *a, **k: [
        speed_row("pp512", 1000, 1000), speed_row("tg128", 100, 99)])
    monkeypatch.setattr(gpu_check.lb, "installed_llama_cpp_version", lambda: "0.3.36")
    code = gpu_check.run(gpu_check.parse_args([str(model)]))
    out, err = capsys.readouterr()
    assert code == 1
    assert out.startswith("GPU: CUDA0 (Fake GPU); backend CUDA") and out.count("| m.gguf |") == 1
    assert err.strip() == ("FAIL m.gguf: the GPU holds 130 MiB after the load, 1.300x the "
                           "estimate (100 MiB), outside ±10%")
    probes[model]["in_use"] = 105 * MiB
    assert gpu_check.run(gpu_check.parse_args([str(model)])) == 0


def test_the_moe_case_is_found_from_the_file(tmp_path):
    """A mixture of experts gets the --cpu-moe comparison (half its layers); a dense model, or a
    file the check cannot read, does not."""
    from tiny_gguf import Shape, write_tiny
    assert gpu_check.moe_layers(write_tiny(tmp_path / "moe.gguf", "qwen3moe", Shape())) == 2
    assert gpu_check.moe_layers(write_tiny(tmp_path / "dense.gguf", "qwen3", Shape())) == 0
    (tmp_path / "bad.gguf").write_bytes(b"GGUF")
    assert gpu_check.moe_layers(tmp_path / "bad.gguf") == 0


def test_the_moe_case_in_a_row(monkeypatch, tmp_path):
    model = tmp_path / "m.gguf"
    monkeypatch.setattr(gpu_check, "run_probe", lambda m, ctx: {
        "estimate": 100 * MiB, "in_use": 101 * MiB, "n_ctx": 4096,
        "offload": {"gpu_layers": 25, "layers": 25}})
    monkeypatch.setattr(gpu_check, "moe_layers", lambda m: 12)
    texts = {(99, 0): "on the GPU", (0, 0): "on the GPU", (99, 12): "on the GPU, and more"}
    monkeypatch.setattr(gpu_check, "greedy_text", lambda m, layers, cpu_moe=0:
                        texts[layers, cpu_moe])
    monkeypatch.setattr(gpu_check.lb, "bench_model", lambda *a, **k: [
        speed_row("pp512", 1000, 1000), speed_row("tg128", 100, 99)])
    row = gpu_check.check_model(model, Path("llama-bench"), gpu_check.parse_args([str(model)]))
    assert (row["cpu_moe"], row["greedy_cpu_moe_vs_gpu"]) == (12, "differs at char 10 of 10")
    assert not gpu_check.failures(row)     # reported, as GPU-vs-CPU rounding is
    table = gpu_check.format_table("h", [row])
    assert "identical; experts of 12 layers in RAM vs all on GPU: differs at char 10" in table
