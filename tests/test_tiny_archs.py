"""Today's architectures through our checks and llama.cpp 0.3.36 (issue 27, sections 3 and 4):
tiny random-weight qwen3, qwen3moe and gpt-oss GGUFs written here (tests/tiny_gguf.py) load
through the header checks, decode, and peak no further from the memory estimate than 10%; the
mixture of experts keeps its experts in host memory through llama.cpp's tensor buffer-type
overrides (--cpu-moe) with greedy output unchanged.

On this CPU-only machine the override to the CPU's buffer type changes where nothing lives, so the
output must be identical token for token; on a GPU machine scripts/gpu_check.py checks the same.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from localinfer.backends import LoadOptions
from localinfer.fit import memory
from localinfer.gguf.checks import check_model
from helpers import run_cli
from tiny_gguf import ARCHITECTURES, Shape, write_tiny

pytestmark = pytest.mark.slow

PROMPT = "the cat sat on the mat and then " * 3
N_CTX = 1024
# About 120 MB of weights: llama.cpp's own cost of loading any model (~10 MB, part of the
# estimate's RUNTIME_BASE) is then small beside what the estimate's model terms predict.
BIG = {"qwen3": Shape(layers=24, n_ff=3072), "qwen3moe": Shape(layers=18),
       "gpt-oss": Shape(layers=18)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny(root / f"{arch}.gguf", arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("big")
    return {arch: write_tiny(root / f"{arch}.gguf", arch, BIG[arch]) for arch in ARCHITECTURES}


def greedy(path: Path, *, cpu_moe: int = 0, n: int = 12) -> tuple[list[int], object]:
    from localinfer.backends.llama.session import LlamaCppSession
    session = LlamaCppSession(path, LoadOptions(n_ctx=N_CTX, n_threads=2, cpu_moe=cpu_moe))
    try:
        logits = session.eval(session.tokenize(PROMPT, special=False), logits="last")
        out = []
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = session.eval(out[-1:])
        return out, session.offload
    finally:
        session.close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_loads_through_our_checks(tiny, arch):
    header = check_model(tiny[arch])
    assert header.metadata["general.architecture"] == arch
    facts = memory.facts_from_file(tiny[arch])
    assert (sum(facts.expert_bytes) > 0) == (arch != "qwen3")
    tokens, offload = greedy(tiny[arch])
    assert len(tokens) == 12 and offload.cpu_moe == 0


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_experts_kept_on_the_cpu_give_the_same_greedy_output(tiny, arch):
    plain, _ = greedy(tiny[arch])
    for n in (2, 6):
        kept, offload = greedy(tiny[arch], cpu_moe=n)
        assert kept == plain, n
        assert offload.cpu_moe == n


def test_the_override_reaches_llama_cpp(tiny):
    """llama.cpp's loader says so when tensors are overridden to the CPU (-vv is its log)."""
    result = run_cli("run", str(tiny["qwen3moe"]), "Hi", "--raw", "--temp", "0", "-n", "2",
                     "--cpu-moe", "3", "--draft", "none", "--no-cache", "-vv")
    assert result.returncode == 0, result.stderr
    assert "tensor overrides to CPU are used" in result.stderr
    plain = run_cli("run", str(tiny["qwen3moe"]), "Hi", "--raw", "--temp", "0", "-n", "2",
                    "--draft", "none", "--no-cache", "-vv")
    assert "tensor overrides to CPU" not in plain.stderr
    assert plain.stdout == result.stdout


@pytest.mark.parametrize("value, message", [("-1", "--cpu-moe"), ("x", "--cpu-moe")])
def test_bad_cpu_moe_is_one_line_and_exit_2(tiny, value, message):
    result = run_cli("run", str(tiny["qwen3moe"]), "Hi", "--cpu-moe", value)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert message in result.stderr


def test_cpu_moe_on_a_dense_model_is_one_line_and_exit_2(tiny):
    result = run_cli("run", str(tiny["qwen3"]), "Hi", "--cpu-moe", "2")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--cpu-moe applies to mixture-of-experts models" in result.stderr


# VmHWM, not getrusage: a child's ru_maxrss starts from its parent's RSS at the fork (Linux keeps
# it across exec), and this test process holds models of its own.
_PEAK = """
import re, sys
from pathlib import Path
from localinfer.backends import LoadOptions
from localinfer.backends.llama.engine import init_engine
init_engine(False)
if sys.argv[1]:
    from localinfer.backends.llama.session import LlamaCppSession
    s = LlamaCppSession(Path(sys.argv[1]), LoadOptions(n_ctx={n_ctx}, n_threads=2))
    tokens = s.tokenize("the cat " * 200, special=False)[:512]   # one full micro-batch
    s.eval(tokens)
    for token in range(4):
        s.eval([token])
status = Path("/proc/self/status").read_text()
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024)
""".format(n_ctx=N_CTX)


def peak_rss(path: Path | None) -> int:
    """Peak RSS of a process that loads `path` and evaluates a full micro-batch (None: one that
    only loads the engine, the baseline)."""
    done = subprocess.run([sys.executable, "-c", _PEAK, str(path or "")], capture_output=True,
                          text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def _estimate(path: Path) -> memory.Estimate:
    return memory.estimate(memory.facts_from_file(path),
                           memory.Request(N_CTX, repack=memory.cpu_repacks()))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_estimate_is_within_10_percent_of_peak_rss(big, arch, record_property):
    """What loading the model adds to a process that has the engine loaded, against the
    estimate's terms for the model (all but RUNTIME_BASE: the interpreter and engine)."""
    baseline = peak_rss(None)
    measured = peak_rss(big[arch]) - baseline
    predicted = _estimate(big[arch]).total - memory.RUNTIME_BASE
    record_property("rss", f"{arch}: measured {measured / 1e6:.1f} MB, estimated "
                           f"{predicted / 1e6:.1f} MB")
    assert abs(predicted - measured) <= 0.10 * measured, (arch, measured, predicted)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_whole_run_peaks_within_10_percent_of_the_estimate(tiny, arch, record_property):
    """The estimate's total is a `localinfer run`'s peak RSS (what `ps` shows), at the tiny size."""
    # A fresh wrapper process, whose child starts small (see _PEAK).
    wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
               "stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
    done = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "localinfer",
                           "run", str(tiny[arch]), "--raw", "--temp", "0", "-n", "4",
                           "--ctx", str(N_CTX), "--draft", "none", "--no-cache",
                           "the cat " * 100], capture_output=True, text=True, check=True)
    measured = int(done.stdout.strip())
    predicted = _estimate(tiny[arch]).total
    record_property("rss", f"{arch}: run peak {measured / 1e6:.1f} MB, estimated "
                           f"{predicted / 1e6:.1f} MB")
    assert abs(predicted - measured) <= 0.10 * measured, (arch, measured, predicted)
