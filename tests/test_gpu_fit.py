"""GPU layers where the fit puts them (issue 16, items 2 and 3).

This machine's llama.cpp is a CPU build, so its registry reports one CPU device. The GPU paths are
tested with described devices handed in at the one function that reads ggml's registry
(`llama_devices.read_registry`): the machine, the budget, the placement, the value that reaches
llama.cpp's model parameters, `-v`, `--json` and `devices` all run as they would on that hardware.
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from localinfer.backends import LoadOptions
from localinfer.backends.llama import devices as llama_devices
from localinfer.backends.llama.devices import Device, placed_layers
from localinfer.fit import gpu, memory, rules
from helpers import MODELS_HOME, run_cli

GiB = 1024 ** 3

LLAMA_7B = memory.ModelFacts(   # Q4_K_M, ~4.4 GB: 32 layers, 8 KV heads of 128 dims
    architecture="llama", file_size=4_400_000_000, n_layer=32, n_embd=4096, n_ff=14336,
    n_vocab=32_000, kv_dims=(8 * 256,) * 32, swa_layers=(False,) * 32, sliding_window=0,
    repackable_bytes=3_000_000_000, context_length=32768)
LLAMA_70B = memory.ModelFacts(  # a 70 GB file: 80 layers, 8 KV heads of 128 dims, 128k vocabulary
    architecture="llama", file_size=70_000_000_000, n_layer=80, n_embd=8192, n_ff=28672,
    n_vocab=128_256, kv_dims=(8 * 256,) * 80, swa_layers=(False,) * 80, sliding_window=0,
    repackable_bytes=0, context_length=131072)
MODELS = {"7B": LLAMA_7B, "70B": LLAMA_70B}


def cpu(total: int) -> Device:
    return Device("CPU", "a CPU", "cpu", "CPU", total, total)


def cuda(name: str, free: float, total: float) -> Device:
    return Device("CUDA0", name, "gpu", "CUDA", int(free * GiB), int(total * GiB))


# name -> (RAM total, RAM available, Apple Silicon, x86 repacking, the engine's devices)
MACHINES = {
    "8 GB M1": (8 * GiB, 5 * GiB, True, False,
                [cpu(8 * GiB), Device("MTL0", "Apple M1", "gpu", "MTL", int(5.3 * GiB),
                                      int(5.3 * GiB))]),
    "16 GB laptop + 6 GB RTX": (16 * GiB, 11 * GiB, False, True,
                                [cpu(16 * GiB), cuda("NVIDIA GeForce RTX 4050 Laptop GPU", 5.6, 6)]),
    "64 GB desktop + 24 GB GPU": (64 * GiB, 58 * GiB, False, True,
                                  [cpu(64 * GiB), cuda("NVIDIA GeForce RTX 4090", 23, 24)]),
    "8 GB CPU-only": (8 * GiB, 6 * GiB, False, True, [cpu(8 * GiB)]),
}


def machine(name: str) -> rules.Machine:
    """A described machine, its GPUs taken from its device list as detect_machine takes them."""
    total, available, apple, repacks, devices = MACHINES[name]
    vram, shared = gpu.memory_of(devices, apple_silicon=apple)
    return rules.Machine(total, available, apple_silicon=apple, metal_working_set=shared,
                         vram_free=vram, repacks=repacks)


# machine, model, asked context -> fits, layers on the GPU (of n_layer + 1), context, KV type
@pytest.mark.parametrize("name, model, n_ctx, fits, layers, ctx, kv", [
    # Unified memory: every layer on Metal, the one pool bounded by Metal's working set.
    ("8 GB M1", "7B", 4096, True, 33, 4096, "f16"),
    ("8 GB M1", "7B", 32768, True, 33, 8192, "q8_0"),
    ("8 GB M1", "70B", 4096, False, 81, 512, "q8_0"),
    # A 6 GB GPU takes a whole 7B at 4k; at 32k the KV cache pushes 14 layers back to RAM.
    ("16 GB laptop + 6 GB RTX", "7B", 4096, True, 33, 4096, "f16"),
    ("16 GB laptop + 6 GB RTX", "7B", 32768, True, 19, 32768, "f16"),
    ("16 GB laptop + 6 GB RTX", "70B", 4096, False, 5, 512, "q8_0"),
    # 24 GB of VRAM and 52 GB of RAM hold a 70 GB model between them.
    ("64 GB desktop + 24 GB GPU", "7B", 32768, True, 33, 32768, "f16"),
    ("64 GB desktop + 24 GB GPU", "70B", 4096, True, 24, 4096, "f16"),
    ("64 GB desktop + 24 GB GPU", "70B", 32768, True, 23, 32768, "q8_0"),
    # No GPU: everything on the CPU, as before.
    ("8 GB CPU-only", "7B", 4096, True, 0, 4096, "f16"),
    ("8 GB CPU-only", "7B", 32768, True, 0, 16384, "q8_0"),
    ("8 GB CPU-only", "70B", 4096, False, 0, 512, "q8_0"),
])
def test_place_on_described_machines(name, model, n_ctx, fits, layers, ctx, kv):
    m = machine(name)
    budget = rules.budget(m)
    placed = rules.place(MODELS[model], m, budget, n_ctx=n_ctx)
    assert (placed.fits, placed.gpu_layers, placed.n_ctx, placed.kv_type) == (fits, layers, ctx, kv)
    assert placed.layers == MODELS[model].n_layer + 1
    if placed.fits and 0 < layers and m.metal_working_set is None:
        # What the GPU holds stays within its free memory, less the headroom.
        assert placed.on_gpu <= budget.vram
        assert placed.needed <= budget.ram
    if placed.fits and layers == 0:
        assert placed.on_gpu == 0


@pytest.mark.parametrize("name, expected", [
    ("8 GB M1", "70B needs at least 70.4 GB (context 512, q8_0 KV cache) but 5.4 GB is available "
                "(Metal recommended working set); it would fit with a smaller quant (Q2_K) or a "
                "budget of 70403.8MB or more (--memory)"),
    ("16 GB laptop + 6 GB RTX",
     "70B needs at least 66.1 GB in RAM with 5 of 81 layers on the GPU (context 512, q8_0 KV "
     "cache) but 10.6 GB is available (available RAM minus headroom + free VRAM); it would fit "
     "with a smaller quant (Q2_K) or a budget of 66077.3MB or more (--memory)"),
    ("8 GB CPU-only", "70B needs at least 70.4 GB (context 512, q8_0 KV cache) but 5.8 GB is "
                      "available (available RAM minus headroom); it would fit with a smaller "
                      "quant (Q2_K) or a budget of 70403.8MB or more (--memory)"),
])
def test_refusal_text(name, expected):
    m = machine(name)
    line = rules.does_not_fit("70B", LLAMA_70B, m, rules.budget(m), kv_type=None,
                              smaller_quant="Q2_K")
    assert line == expected


def test_the_budget_it_names_is_enough_with_the_gpu_kept():
    """--memory sets the RAM; a discrete GPU keeps its share, so the refusal's figure fits."""
    m = machine("16 GB laptop + 6 GB RTX")
    budget = rules.budget(m, 66_077_300_000)
    assert budget.vram == rules.budget(m).vram > 0
    assert rules.place(LLAMA_70B, m, budget, n_ctx=512).fits


def test_unified_memory_is_counted_once():
    m = machine("8 GB M1")
    budget = rules.budget(m)
    assert (budget.ram, budget.vram) == (5 * GiB, 0)     # the RAM available, never RAM + GPU
    assert m.vram_free == 0


def test_two_gpus_share_the_layers():
    devices = [cpu(64 * GiB), cuda("a", 10, 12), replace(cuda("b", 7, 8), name="CUDA1")]
    assert gpu.memory_of(devices, apple_silicon=False) == (17 * GiB, None)


def test_an_integrated_gpu_shares_the_ram_and_is_passed_over_for_a_discrete_one():
    igpu = Device("Vulkan0", "Intel Iris Xe", "igpu", "Vulkan", 6 * GiB, 8 * GiB)
    assert gpu.memory_of([cpu(16 * GiB), igpu], apple_silicon=False) == (0, 6 * GiB)
    assert gpu.memory_of([cpu(16 * GiB), igpu, cuda("d", 5, 6)], apple_silicon=False) == \
        (5 * GiB, None)


@pytest.mark.parametrize("asked, n_layer, devices, expected", [
    (-1, 30, [cpu(GiB), cuda("g", 4, 8)], 31),      # llama.cpp's default: all, output included
    (99, 30, [cpu(GiB), cuda("g", 4, 8)], 31),      # more than there are: all
    (12, 30, [cpu(GiB), cuda("g", 4, 8)], 12),
    (0, 30, [cpu(GiB), cuda("g", 4, 8)], 0),
    (-1, 30, [cpu(GiB)], 0),                        # a CPU build ignores the count
])
def test_llama_cpp_layer_rule(asked, n_layer, devices, expected):
    offload = placed_layers(asked, n_layer, devices)
    assert (offload.gpu_layers, offload.layers) == (expected, n_layer + 1)
    assert bool(offload.devices) == (expected > 0)


@pytest.mark.parametrize("gpu_layers, layers", [(None, 33), (10, 10), (0, 0), (500, 33)])
def test_gpu_layers_option_fixes_the_count(gpu_layers, layers):
    m = machine("16 GB laptop + 6 GB RTX")
    placed = rules.place(LLAMA_7B, m, rules.budget(m), n_ctx=4096, gpu_layers=gpu_layers)
    assert placed.gpu_layers == layers and placed.fits


# -- the device registry, faked at the one function that reads it ---------------------------------
def test_this_machine_reports_its_cpu():
    found = llama_devices.read_registry()
    assert [d.kind for d in found if d.kind == "cpu"] == ["cpu"]
    assert all(d.memory_total > 0 for d in found)


SMALL_GPU = [cpu(16 * GiB), Device("CUDA0", "Fake RTX with 60 MB free", "gpu", "CUDA",
                                   60 * 1024 ** 2, 6 * GiB)]


@pytest.fixture
def small_gpu(monkeypatch):
    """The engine reports a GPU whose free memory holds only a few of SmolLM2's layers."""
    monkeypatch.setattr(llama_devices, "read_registry", lambda: list(SMALL_GPU))
    monkeypatch.setattr(rules.memory, "cpu_repacks", lambda: True)


def test_detected_machine_takes_the_gpu_from_the_registry(small_gpu):
    m = rules.detect_machine()
    assert m.vram_free == 60 * 1024 ** 2 and m.metal_working_set is None


def in_process(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """The real CLI in this process (so the fake registry applies): exit code, stdout, stderr."""
    from localinfer.cli.app import main
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))       # nothing piped
    monkeypatch.setenv("LOCALINFER_HOME", str(MODELS_HOME))
    monkeypatch.setenv("NO_COLOR", "1")
    with pytest.raises(SystemExit) as ended:
        main(list(args))
    out, err = capsys.readouterr()
    return ended.value.code, out, err


@pytest.mark.slow
def test_a_gpu_with_too_little_free_memory_gets_some_layers(models_home, small_gpu, monkeypatch,
                                                            capsys):
    """The placement's count reaches llama.cpp's model parameters; -v and --json say where the
    layers went."""
    from localinfer.backends.llama import engine as llama_cpp
    lib = llama_cpp.engine()
    seen = []
    real_load = lib.llama_model_load_from_file

    def load(path, params):
        seen.append(params.n_gpu_layers)
        return real_load(path, params)
    monkeypatch.setattr(lib, "llama_model_load_from_file", load)
    from localinfer.fit import auto
    from localinfer.fit.options import FitOptions
    from localinfer.models import refs
    monkeypatch.setenv("LOCALINFER_HOME", str(models_home))
    fit = FitOptions(offline=True)
    fitted = auto.resolve(refs.name("smollm2", fit.quant, offline=True), fit)
    assert 0 < fitted.gpu_layers < 31            # a split: SmolLM2 has 30 layers + output
    code, out, err = in_process(monkeypatch, capsys, "run", "smollm2", "Hi", "-n", "2", "--temp",
                                "0", "-v", "--json", "--no-cache", "--draft", "none", "--offline")
    assert code == 0, err
    assert seen == [fitted.gpu_layers]
    offload = json.loads(out)["offload"]
    assert offload == {"gpu_layers": fitted.gpu_layers, "cpu_layers": 31 - fitted.gpu_layers,
                       "layers": 31, "engine_has_gpu": True, "cpu_moe_layers": 0,
                       "gpu_devices": ["CUDA0 (Fake RTX with 60 MB free)"],
                       "device_layers": {"CUDA0 (Fake RTX with 60 MB free)": fitted.gpu_layers}}
    assert f"layers: {fitted.gpu_layers} of 31 on the GPU (CUDA0 (Fake RTX" in err


@pytest.mark.slow
def test_gpu_layers_option_reaches_llama_cpp(models_home, smollm_path):
    from localinfer.backends.llama.session import LlamaCppSession
    session = LlamaCppSession(smollm_path, LoadOptions(n_ctx=512, n_threads=2, gpu_layers=7))
    try:    # a CPU build: llama.cpp has nowhere to put them, and says so through the session
        assert (session.offload.gpu_layers, session.offload.layers) == (0, 31)
        assert session.offload.no_gpu
    finally:
        session.close()


def test_devices_lists_every_device_with_type_and_memory(small_gpu, monkeypatch, capsys):
    code, out, _ = in_process(monkeypatch, capsys, "devices")
    assert code == 0
    assert "device CUDA0" in out and "gpu · Fake RTX with 60 MB free · 62.9 MB free of 6.4 GB" in out
    assert "device CPU" in out and "cpu · a CPU" in out
    code, out, _ = in_process(monkeypatch, capsys, "devices", "--json")
    listed = json.loads(out)["devices"]
    assert [(d["name"], d["kind"], d["memory_free"], d["memory_total"]) for d in listed] == \
        [(d.name, d.kind, d.memory_free, d.memory_total) for d in SMALL_GPU]


# -- a GPU the engine cannot use: say so, with the command that fixes it -------------------------
def test_gpu_drivers_are_found(tmp_path: Path):
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/kfd").touch()
    found = gpu.present(tmp_path)
    assert [(h.what, h.backend) for h in found] == [("an NVIDIA GPU", "CUDA"),
                                                    ("an AMD GPU", "ROCm")]
    assert gpu.present(tmp_path / "nothing") == []
    assert [h.backend for h in gpu.present(tmp_path / "nothing", apple_silicon=True)] == ["MTL"]


@pytest.mark.parametrize("backend, cmake", [("CUDA", "-DGGML_CUDA=on"), ("ROCm", "-DGGML_HIP=on"),
                                            ("MTL", "-DGGML_METAL=on")])
def test_rebuild_hint(backend, cmake):
    hardware = [gpu.Hardware("a GPU", "/somewhere", backend)]
    line = gpu.rebuild_hint(hardware, [cpu(GiB)], python="/home/u/my env/bin/python",
                            version="0.3.36")
    assert line.endswith(f'CMAKE_ARGS="{cmake}" \'/home/u/my env/bin/python\' -m pip install '
                         "--force-reinstall --no-cache-dir --no-deps --no-binary llama-cpp-python "
                         "llama-cpp-python==0.3.36")
    assert "has no GPU backend" in line and "\n" not in line
    # No hint when the engine has a GPU, when there is no GPU, or when there is no engine to ask.
    assert gpu.rebuild_hint(hardware, [cpu(GiB), cuda("g", 1, 2)], python="p", version="v") is None
    assert gpu.rebuild_hint([], [cpu(GiB)], python="p", version="v") is None
    assert gpu.rebuild_hint(hardware, [], python="p", version="v") is None


@pytest.fixture
def nvidia_driver(monkeypatch):
    """An NVIDIA driver is loaded, but this engine (the real, CPU-only one) has no GPU backend."""
    monkeypatch.setattr(gpu, "present", lambda root=None, apple_silicon=False: [
        gpu.Hardware("an NVIDIA GPU", "/proc/driver/nvidia", "CUDA")])


def test_devices_prints_the_reinstall_command(nvidia_driver, monkeypatch, capsys):
    code, out, err = in_process(monkeypatch, capsys, "devices")
    assert code == 0 and "CMAKE_ARGS" not in out         # stdout stays the table
    assert err.count("\n") == 1 and "an NVIDIA GPU is present (/proc/driver/nvidia)" in err
    assert 'CMAKE_ARGS="-DGGML_CUDA=on"' in err and "llama-cpp-python==0.3.36" in err
    code, out, err = in_process(monkeypatch, capsys, "devices", "--json")
    assert 'CMAKE_ARGS=\\"-DGGML_CUDA=on\\"' in out and "CMAKE_ARGS" in err


@pytest.mark.slow
def test_run_verbose_says_no_gpu_backend_and_how_to_get_one(models_home, nvidia_driver,
                                                            monkeypatch, capsys):
    code, _, err = in_process(monkeypatch, capsys, "run", "smollm2", "Hi", "-n", "2", "--temp",
                              "0", "-v", "--no-cache", "--draft", "none", "--offline")
    assert code == 0, err
    assert "layers: 0 of 31 on the GPU (this llama.cpp build has no GPU backend), 31 on the CPU" \
        in err
    assert 'CMAKE_ARGS="-DGGML_CUDA=on"' in err


# -- through the real CLI, as a user runs it ------------------------------------------------------
@pytest.mark.parametrize("value", ["-3", "abc", "1.5", "99999999", ""])
def test_bad_gpu_layers_is_a_usage_error(value, home):
    result = run_cli("run", "smollm2", "Hi", "--gpu-layers", value, home=home)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "--gpu-layers" in result.stderr
    assert not (home / "data").exists()            # refused before any pull or load


@pytest.mark.slow
def test_run_verbose_on_this_cpu_only_machine(models_home):
    result = run_cli("run", "smollm2", "Hi", "-n", "2", "--temp", "0", "-v", "--no-cache",
                     "--draft", "none")
    assert result.returncode == 0, result.stderr
    assert "layers: 0 of 31 on the GPU (this llama.cpp build has no GPU backend)" in result.stderr
    result = run_cli("run", "smollm2", "Hi", "-n", "2", "--temp", "0", "--json", "--no-cache",
                     "--draft", "none", "--gpu-layers", "0")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["offload"]["gpu_layers"] == 0
